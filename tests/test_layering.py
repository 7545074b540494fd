"""The pure core stays pure: importing cache and router pulls in neither torch nor ray."""

import subprocess
import sys


def test_cache_and_router_import_without_torch_or_ray():
    code = (
        "import sys, cache, router\n"
        "heavy = sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"pure core imported {out.stdout.strip()}"
