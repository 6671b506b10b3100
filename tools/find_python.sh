# Sourced by tools/setup.sh and tests/run.sh: find_python 3.12 prints an interpreter of that minor version.
find_python() {
  local want=$1 cand v
  for cand in "python$want" python3; do
    if command -v "$cand" >/dev/null &&
       "$cand" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  if command -v pyenv >/dev/null; then  # pyenv's shims refuse a version that is installed but not selected
    v=$(pyenv versions --bare 2>/dev/null | grep -E "^$want(\.[0-9]+)?$" | tail -n 1 || true)
    if [[ -n $v ]]; then echo "$(pyenv root)/versions/$v/bin/python$want"; return 0; fi
  fi
  echo "no Python $want found: install it, or set PYTHON${want/./} to one" >&2
  return 1
}
