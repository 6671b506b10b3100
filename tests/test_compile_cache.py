"""The persistent compilation cache's folder per host CPU (k2jax.runtime.compiles.host_cpu_key): XLA:CPU
programs are built for the CPU that compiled them, so hosts whose CPUs differ must not share one."""

import jax

from k2jax.runtime.compiles import host_cpu_key
from k2jax.serving.server import use_compile_cache

BLOCK = """processor\t: {n}
vendor_id\t: AuthenticAMD
model name\t: {model}
cpu MHz\t\t: {mhz}
flags\t\t: fpu sse sse2 {extra}

"""


def _cpuinfo(tmp_path, name, model="AMD EPYC", extra="avx2", mhz="2000.000", cpus=2):
    path = tmp_path / name
    path.write_text("".join(BLOCK.format(n=n, model=model, mhz=mhz, extra=extra) for n in range(cpus)))
    return str(path)


def test_the_key_follows_the_cpu_model_and_its_instruction_set_only(tmp_path):
    base = host_cpu_key(_cpuinfo(tmp_path, "a"))
    assert base == host_cpu_key(_cpuinfo(tmp_path, "b", mhz="3100.5", cpus=8))  # clock and core count: same
    assert base != host_cpu_key(_cpuinfo(tmp_path, "c", extra="avx2 avx512f"))  # another instruction set
    assert base != host_cpu_key(_cpuinfo(tmp_path, "d", model="Intel Xeon"))
    assert host_cpu_key() == host_cpu_key()  # this host's, stable


def test_the_servers_default_cache_is_a_folder_per_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        use_compile_cache(None)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / ".cache" / "k2jax" / "xla" / host_cpu_key())
        use_compile_cache(str(tmp_path / "mine"))  # a folder the user names is theirs, as named
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
