"""Does a client's hang-up reach the Worker? Streams abandoned after their
first token, one at a time, and what the Workers did with each.

    python -m harness.abandon_probe [--haproxy] [--tries 6] [--json OUT]

Each try streams a 400-token ``/generate``, leaves after the first token,
then reads ``/stats`` until nothing runs: ``(aborted, decoded)`` is how many
requests the Workers aborted and how many tokens they decoded meanwhile.
Aborted means the hang-up got through (a few tokens decoded); 0 aborted
and ~400 decoded means the stream ran to its end for nobody. With
``--haproxy`` the app runs behind Serve's HAProxy ingress
(harness/haproxy_ingress.py; Serve's ``RAY_SERVE_HAPROXY_*`` settings come
from the environment). RELIABILITY.md section 2 has the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import httpx

from harness.haproxy_ingress import HAProxyApp
from harness.serving import ServeApp


def _totals(url: str, headers: dict | None) -> tuple[int, int, bool]:
    replicas = httpx.get(f"{url}/stats", headers=headers, timeout=10, trust_env=False).json()["replicas"].values()
    return (sum(r["num_aborted"] for r in replicas), sum(r["decode_tokens"] for r in replicas),
            all(r["num_running"] == 0 for r in replicas))


def abandon_streams(url: str, tries: int = 6, max_new_tokens: int = 400, seed: int = 0,
                    settle_s: float = 20.0, headers: dict | None = None) -> list[tuple[int, int]]:
    """``(aborted, decoded)`` per try (module docstring)."""
    rng, results = random.Random(seed), []
    for _ in range(tries):
        aborted_before, decoded_before, _ = _totals(url, headers)
        body = {"prompt_token_ids": [rng.randrange(32, 127) for _ in range(50)], "max_new_tokens": max_new_tokens,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/generate", json=body, headers=headers, timeout=60,
                          trust_env=False) as response:
            for line in response.iter_lines():
                if '"token_id"' in line:
                    break  # leave after the first token
        left = time.monotonic()
        while time.monotonic() - left < settle_s:  # the stats are posted every period: wait at least one
            aborted, decoded, idle = _totals(url, headers)
            if idle and time.monotonic() - left > 1.0:
                break
            time.sleep(0.25)
        results.append((aborted - aborted_before, decoded - decoded_before))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.abandon_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--haproxy", action="store_true", help="behind Serve's HAProxy ingress")
    parser.add_argument("--tries", type=int, default=6)
    parser.add_argument("--config", default="deploy/config.yaml")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with (HAProxyApp if args.haproxy else ServeApp)(args.config) as app:
        app.deploy()
        results = abandon_streams(app.url, tries=args.tries)
    figures = {"front": "haproxy" if args.haproxy else "proxy", "aborted_decoded_per_try": results,
               "num_aborted": sum(aborted > 0 for aborted, _ in results), "tries": len(results)}
    print(json.dumps(figures))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
