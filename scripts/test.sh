#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra args go to pytest.
# pytest exits 5 when it collected no tests; that is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; failing on purpose" >&2
  exit 1
fi
exit "$rc"
