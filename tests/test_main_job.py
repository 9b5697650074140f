"""scripts/main_job.py's choice of the fast float path (the job itself runs as the README's main
command; tests/lmdeploy covers the engine it drives)."""

from main_job import fast_path  # scripts/ is on pytest's pythonpath (pyproject.toml)


def test_bfloat16_only_where_the_cpu_has_avx512_bf16_and_graph_mode_always():
    assert fast_path(["avx2", "avx512f", "avx512_bf16", "amx_tile"]) == ("bfloat16", True)
    assert fast_path(["avx2", "avx512f", "avx512_vnni"]) == ("float32", True)
    assert fast_path(["avx2"]) == ("float32", True)
    assert fast_path(None) == ("float32", True)  # no /proc/cpuinfo flags: the safe dtype
