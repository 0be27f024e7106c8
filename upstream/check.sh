#!/usr/bin/env bash
# A framework maintainer's view of a patch series in upstream/: applies upstream/<framework>/*.patch
# to a copy of the framework tree you point it at, then runs that framework's own tests (the ones
# that import a module the series changes, and the ones it adds) in both trees, with mcore-hooks
# importable and with it hidden (`import mcore_hooks` raising ImportError, as where it is not
# installed), and compares every test's outcome with the released tree's.
#
#   upstream/check.sh verl    /path/to/verl-checkout    [extra pytest arguments]
#   upstream/check.sh nemo-rl /path/to/RL-checkout      [extra pytest arguments]
#
# Run it with the Python of an environment that has the framework's test dependencies, Megatron
# Core and mcore-hooks installed (PYTHON=..., default python3). TREE is the framework as released
# (a checkout at the release the series is against, without the series: the script applies it);
# it is not modified: both trees are copies under a temporary folder (kept with KEEP=1), and the
# framework is imported from them (PYTHONPATH; checked). Documentation the series changes that
# the tree does not have (verl's docs/, absent from its sdist) is left out, and said so; any
# other file missing is an error. The framework's own pytest addopts are dropped (NeMo RL's -x
# would stop at the first failure); arguments after TREE go to pytest. Exit status 1 when a test that passes in the released tree
# does not pass in the patched one (with or without mcore-hooks), or when a patch does not apply.
set -euo pipefail
if [ "${BASH_VERSINFO[0]}" -lt 4 ] || { [ "${BASH_VERSINFO[0]}" -eq 4 ] && [ "${BASH_VERSINFO[1]}" -lt 4 ]; }; then
  echo "upstream/check.sh needs bash 4.4 or later" >&2; exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
framework=${1:?usage: upstream/check.sh verl|nemo-rl TREE [pytest args]}
tree=$(cd "${2:?usage: upstream/check.sh verl|nemo-rl TREE [pytest args]}" && pwd)
shift 2
series=("$here/$framework"/*.patch)
[ -f "${series[0]}" ] || { echo "no patch series in $here/$framework" >&2; exit 2; }
PYTHON=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/check-$framework.XXXXXX")
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
export GIT_CEILING_DIRECTORIES=$work

echo "== $framework at $tree ($(git -C "$tree" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout'))"
for name in released patched; do
  mkdir -p "$work/$name"
  (cd "$tree" && tar --exclude=.git -cf - .) | tar -xf - -C "$work/$name"
done
git -C "$work/patched" init -q
for p in "${series[@]}"; do
  excludes=()  # documentation the patch changes that this tree does not have
  while read -r f; do
    [ -n "$f" ] || continue
    case "$f" in
      docs/*) excludes+=("--exclude=$f") && echo "   $(basename "$p"): $f is not in this tree: left out" ;;
      *) echo "$(basename "$p") changes $f, which $tree does not have: not the release the series is against?" >&2; exit 1 ;;
    esac
  done < <("$PYTHON" -c '
import re, sys
from pathlib import Path
text, tree = Path(sys.argv[1]).read_text(), Path(sys.argv[2])
for old, new in re.findall(r"^--- (\S+)\n\+\+\+ (\S+)$", text, re.MULTILINE):
    if old != "/dev/null" and not (tree / old[2:]).exists():
        print(old[2:])
' "$p" "$work/patched")
  git -C "$work/patched" apply --whitespace=error "${excludes[@]}" "$p" \
    || { echo "$(basename "$p") does not apply to $tree" >&2; exit 1; }
  echo "   applied $(basename "$p")"
done

# The tests: those the series adds, and those that import a module it changes.
"$PYTHON" - "$work" "${series[@]}" > "$work/tests.txt" <<'EOF'
import re, sys
from pathlib import Path

work, patches = Path(sys.argv[1]), sys.argv[2:]
changed, added = set(), set()
for p in patches:
    text = Path(p).read_text()
    for old, new in re.findall(r"^--- (\S+)\n\+\+\+ (\S+)$", text, re.MULTILINE):
        path = new[2:] if new.startswith("b/") else old[2:]
        if path.startswith("tests/") and path.endswith(".py") and Path(path).name.startswith("test_"):
            added.add(path)
        elif path.endswith(".py") and not path.startswith("tests/"):
            changed.add(path[:-3].replace("/", "."))
patched = work / "patched"
uses = set()
for test in (patched / "tests").rglob("test_*.py"):
    rel = test.relative_to(patched).as_posix()
    if "/special_" in rel or rel.startswith("tests/special_"):
        continue  # GPU / multi-node suites
    source = test.read_text(errors="ignore")
    for module in changed:
        parent, _, name = module.rpartition(".")
        if re.search(rf"\b{re.escape(module)}\b|from {re.escape(parent)} import [^\n]*\b{name}\b", source):
            uses.add(rel)
print("\n".join(sorted(added | uses)))
EOF
mapfile -t tests < "$work/tests.txt"
echo "   ${#tests[@]} test files: ${tests[*]}"
cat > "$work/hide_mcore_hooks.py" <<'EOF'
import sys

sys.modules["mcore_hooks"] = None  # `import mcore_hooks` raises ImportError, as where it is not installed
EOF

package=${framework//-/_}  # verl, nemo_rl
for name in released patched; do  # the framework is imported from the copy, not from an install
  where=$(cd "$work/$name" && PYTHONPATH="$work/$name" "$PYTHON" -c "import importlib.util as u; print(u.find_spec('$package').origin)" 2>/dev/null || true)
  case "$where" in
    "$work/$name"/*) ;;
    *) echo "$package is imported from '${where:-nowhere}', not from the $name copy" >&2; exit 2 ;;
  esac
done

run() {  # tree, mcore-hooks (importable|hidden)
  local name=$1 mode=$2 present=() files=()
  shift 2
  [ "$mode" = hidden ] && present=(-p hide_mcore_hooks)
  for t in "${tests[@]}"; do [ -e "$work/$name/$t" ] && files+=("$t"); done
  if [ "${#files[@]}" = 0 ]; then  # pytest without paths would run the whole suite
    echo '<testsuites><testsuite/></testsuites>' > "$work/$name-$mode.xml"
    echo "   $name, mcore-hooks $mode: none of the test files is in this tree"
    return
  fi
  present+=("${files[@]}")
  (cd "$work/$name" && PYTHONPATH="$work/$name:$work${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pytest -q \
     -p no:cacheprovider -o addopts= --continue-on-collection-errors --junitxml="$work/$name-$mode.xml" "${present[@]}" "$@" > "$work/$name-$mode.log" 2>&1) || true
  echo "   $name, mcore-hooks $mode: $(tail -n 1 "$work/$name-$mode.log")"
}
echo "== the framework's tests"
for mode in importable hidden; do
  run released "$mode" "$@"
  run patched "$mode" "$@"
done

"$PYTHON" - "$work" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

work = Path(sys.argv[1])

def outcomes(name):
    root = ET.parse(work / f"{name}.xml").getroot()
    out = {}
    for case in root.iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        out[f"{case.get('classname')}::{case.get('name')}"] = kind
    return out

worse = 0
for mode in ("importable", "hidden"):
    released, patched = outcomes(f"released-{mode}"), outcomes(f"patched-{mode}")
    if not any(o == "passed" for o in released.values()):
        print(f"== mcore-hooks {mode}: no test passed in the released tree: nothing to compare "
              f"(is the framework's environment installed? see {work}/released-{mode}.log)")
        worse += 1
        continue
    lost = sorted(t for t, o in released.items() if o == "passed" and patched.get(t) != "passed")
    new = sorted(t for t in patched if t not in released)
    print(f"== mcore-hooks {mode}: {len(lost)} test(s) passing in the released tree do not in the patched one;"
          f" {len(new)} new in the patched tree ({sum(patched[t] == 'passed' for t in new)} passed,"
          f" {sum(patched[t] == 'skipped' for t in new)} skipped, "
          f"{sum(patched[t] in ('failure', 'error') for t in new)} failed)")
    for t in lost:
        print(f"   LOST: {t} ({patched.get(t, 'not run')})")
    for t in new:
        if patched[t] in ("failure", "error"):
            print(f"   NEW, FAILING: {t}")
    worse += len(lost) + sum(patched[t] in ("failure", "error") for t in new)
print(f"== logs and JUnit XML in {work}" + (" (kept)" if __import__("os").environ.get("KEEP") == "1" else ""))
sys.exit(1 if worse else 0)
EOF
