"""harness.handoff_bench: a smoke run of the script (the figures are BENCHMARKS.md's)."""


def test_the_handoff_bench_times_both_paths_on_the_deployed_engine(capsys):
    """harness.handoff_bench runs deploy/config.yaml's engine and prints the
    AsyncEngine's TTFT beside the plain step loop's time and their difference."""
    import torch

    from harness.handoff_bench import main
    from harness.serving import config_engine_args
    from worker.config import EngineConfig

    config = EngineConfig(**config_engine_args())  # what the bench runs
    assert config.model == "tiny-llama" and config.cache_budget_tokens == 65536
    threads = torch.get_num_threads()
    try:
        assert main(["--requests", "4", "--warmup", "1", "--prompt-tokens", "16", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)  # the script sets the process's torch threads
    out = capsys.readouterr().out
    assert "16-token prompts, 3 timed" in out and "AsyncEngine ttft_s" in out and "hand-off (difference)" in out
