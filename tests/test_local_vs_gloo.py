"""benchmarks/local_vs_gloo.py's rule for a local world's skip: one that names the kit's own line as needing one
rank's value is the kit's bug, a disagreement (a planter slicing by the rank hid as a limit, session 22); one
inside torch or the library stays the local world's named limit."""

from tests.support import script


def _compare():
    return script("local_vs_gloo", "benchmarks")


def test_a_skip_at_the_kits_own_line_is_a_disagreement_one_inside_torch_a_limit():
    compare = _compare()
    skip = "one process cannot run this case as every rank: RankDependent: int of a value that differs between ranks "
    kit = skip + "(0, 1) at /w/paracheck/adapters/diffusers/pipelines/controls.py:100 (plant): ..."
    torch_need = skip + ("(0, 1) at /w/paracheck/adapters/torch/adapter.py:80 (shard), in "
                         "/x/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_param.py:299 (_init): ...")
    library = skip + "(0, 1) at /x/site-packages/diffusers/hooks/first_block_cache.py:120 (new_forward): ..."
    torch_adapter = skip + "(0, 1) at /w/paracheck/adapters/torch/controls.py:66 (plant): ..."  # the kit's own
    assert compare.kits_own(kit) and compare.kits_own(torch_adapter)
    assert not compare.kits_own(torch_need) and not compare.kits_own(library)
    local = {c: {"status": "skip", "reason": r, "checks": []} for c, r in (("a", kit), ("b", torch_need))}
    gloo = {c: {"status": "detected", "reason": "", "checks": []} for c in ("a", "b")}
    limits = []
    found, _, compared, _ = compare.compare(local, gloo, limits)
    assert len(found) == 1 and found[0].startswith("a: skip here") and len(limits) == 1 and compared == 0
