#!/usr/bin/env bash
# Set up both environments (cached between runs) and run the whole test suite.
#   k2jax's own environment: Python >= 3.12 (.venv, editable install with the `test` extra).
#   The oracle: HuggingFace transformers + torch 2.13 CPU under Python 3.11, called by the parity tests
#   in a subprocess; K2JAX_REQUIRE_ORACLE=1 makes a missing oracle a failure instead of a skip.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${K2JAX_CACHE:-$HOME/.cache/k2jax}"
mkdir -p "$cache"

source tools/find_python.sh

py312=${PYTHON312:-$(find_python 3.12)}
py311=${PYTHON311:-$(find_python 3.11)}

# build ENV PYTHON PIP-ARGS...: a venv at ENV with PIP-ARGS installed, unless a finished one is there. A venv
# cannot be moved (absolute paths inside), so a stamp file marks a finished build.
build() {
  local env=$1 python=$2
  shift 2
  [[ -f $env/.complete ]] && return 0
  echo "== building $env"
  rm -rf "$env"
  "$python" -m venv "$env"
  "$env/bin/pip" install -q --upgrade pip
  "$env/bin/pip" install -q "$@"
  touch "$env/.complete"
}

# Main environment: dependencies cached by the hash of setup.cfg; the project itself installed editable.
main_env="$cache/venv-$(sha1sum setup.cfg | cut -c1-12)"
build "$main_env" "$py312" -e '.[test]'
# Point the cached environment at this checkout (quick: no dependencies resolved).
"$main_env/bin/pip" install -q --no-deps -e . 2>&1 | { grep -v "is ignored" || true; }

# Oracle environment, cached by the hash of its requirements.
oracle_env="$cache/oracle-$(sha1sum tests/oracle/requirements.txt | cut -c1-12)"
build "$oracle_env" "$py311" -r tests/oracle/requirements.txt
export K2JAX_ORACLE_PYTHON="$oracle_env/bin/python"
export K2JAX_REQUIRE_ORACLE=1
export K2JAX_REQUIRE_TPU_AOT=1  # the test extra brings libtpu: the TPU compile checks (tests/test_aot.py) must run

# XLA's persistent compilation cache, kept between runs like the environments: the suite compiles many of the
# same programs (servers in subprocesses, the TPU checks) run after run. A program read from it still counts as
# a compilation for the no-recompile tests (k2jax.runtime.compiles). Every program goes in, however quick its
# compile (a test server compiles dozens of small ones). No size limit for jax to keep: with one, each write
# scans every entry under a file lock, and caching every program made the suite slower (1760 s against 1593 s
# with only the programs of a second or more); instead the whole cache starts afresh past 4 GiB. (The TPU
# checks gain nothing: a compile-only TPU client cannot load a cached executable back.)
# One cache per host CPU (k2jax.runtime.compiles.host_cpu_key): XLA:CPU builds for the CPU it runs on and
# jax's cache key does not say which, so a cache kept between runs on machines whose CPUs differ would hand
# programs to CPUs they were not built for. The files of the earlier, shared cache (one folder for every CPU)
# go, and so do the training steps' programs (jit_step), which tests/conftest.py keeps out of the cache: XLA:CPU
# crashed writing and reading them there.
cpu_key=$("$main_env/bin/python" -c "from k2jax.runtime.compiles import host_cpu_key; print(host_cpu_key())")
[[ -d $cache/xla ]] && find "$cache/xla" -maxdepth 1 -type f -delete
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$cache/xla/$cpu_key}"
[[ -d $JAX_COMPILATION_CACHE_DIR ]] && find "$JAX_COMPILATION_CACHE_DIR" -maxdepth 1 -name 'jit_step-*' -delete
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
# The TPU compiler's outputs for the full-model checks (k2jax.aot.compile): nine minutes of compiling otherwise.
export K2JAX_AOT_CACHE="${K2JAX_AOT_CACHE:-$cache/aot}"
for dir in "$JAX_COMPILATION_CACHE_DIR" "$K2JAX_AOT_CACHE"; do
  if [[ -d $dir ]] && (( $(du -sm "$dir" | cut -f1) > 4096 )); then
    echo "== $dir over 4 GiB: starting it afresh"
    rm -rf "$dir"
  fi
done

# Each test file in a fresh pytest process, two at a time (K2JAX_TEST_WORKERS; 0 runs one plain pytest), longest
# first by the times of the last run. XLA:CPU workaround: pytest-xdist's workers run file after file in one
# process, and a worker died in native code on tests that passed alone every time (tests/run_files.py).
export K2JAX_TEST_TIMES="${K2JAX_TEST_TIMES:-$cache/test-seconds.json}"
set +e
"$main_env/bin/python" tests/run_files.py "$@"
rc=$?
set -e
if [[ $rc == 5 ]]; then  # pytest: no tests collected
  echo "pytest collected no tests"; exit 1
fi

# Floor environment: every dependency with a floor in setup.cfg at exactly that version (jaxlib = jax), cached
# by the hash of that list; a named subset of the fast tests (model, parity, sharding, converter) runs on it.
# Runs after a full run (no arguments), or with K2JAX_FLOOR=1; K2JAX_FLOOR=0 skips it.
if [[ ${K2JAX_FLOOR:-$([[ $# == 0 ]] && echo 1 || echo 0)} == 1 ]]; then
  floors=$(sed -n '/^install_requires =/,/^[^ ]/p' setup.cfg | grep '>=' | sed 's/ //g; s/>=/==/')
  floor_env="$cache/floor-$(echo "$floors" | sha1sum | cut -c1-12)"
  # shellcheck disable=SC2086
  build "$floor_env" "$py312" $floors numpy ml_dtypes tqdm pytest
  # A few minutes on 2 cores: the tokenizer, the model, parity against transformers, the converter, the
  # expert-parallel MoE (forward and gradients) and the fallback sharding.
  floor_tests="test_versions or test_tokenizer or test_scan_equals_blocks or test_blocked_forward or (test_parity and
    (test_logits or test_attention)) or test_equals_load_hf_bit_exact or test_plain_orbax or
    test_exchanges_equal_dense or (test_exchange_gradients_equal_dense and gather and data) or
    test_the_fallback_rule or test_train_step_on_a_mesh or ((test_sharded_logits_equal_one_device_on_any_mesh or
    test_plan_bytes_equal_a_sharded_load) and odd97)"
  echo "== floor versions: $(echo $floors)"
  set +e
  # (no compilation cache there: other jax versions' programs would only fill it)
  env -u JAX_COMPILATION_CACHE_DIR PYTHONPATH=$PWD "$floor_env/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_versions.py tests/test_tokenizer.py tests/test_model.py tests/test_parity.py tests/test_convert.py \
    tests/test_sharding.py tests/test_sharding_any.py -m "not slow" -k "$(echo $floor_tests)"
  frc=$?
  set -e
  [[ $rc == 0 ]] && rc=$frc
fi
exit $rc
