"""bytescheduler's DDP communication hook against torch's own allreduce_hook, on real processes.

Every case builds one model per rank (same seed), wraps a deepcopy of it in DDP with torch's
``default_hooks.allreduce_hook`` (the reference) and further deepcopies in DDP with
``bytescheduler.pytorch.scheduled_allreduce_hook`` under several scheduler settings, trains all
of them for a few SGD-with-momentum steps on the same per-rank data and compares gradients and
parameters with the reference.

Expected agreement: on 2 ranks every setting must be bit-identical (a + b == b + a); on 3 ranks
only whole, unmerged buckets are (the reduction order inside gloo depends on the tensor it is
given), the others must agree within a relative 1e-6 (fp32) or a few units of the dtype's
rounding error (fp16, bf16).

Each run_ranks call spawns fresh processes (~4 s), so one call runs several cases.
"""

from __future__ import annotations

import copy
import hashlib
import math
from datetime import timedelta

import pytest
import torch
import torch.nn as nn

from tests.distributed import run_ranks

IN_FEATURES = 8
OUT_FEATURES = 4
BATCH = 6
TIMEOUT = 60  # the scheduler's own timeout; all configs share it, so one communicator per group

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Scheduler settings compared in each case. "exact3": bit-identical on 3 ranks too.
# Every config keeps the scheduled path (adaptive=False): the mode switch has tests of its own.
CONFIGS = {
    # Tiny pieces, fused across buckets, small credit and a fast lane: stresses every mechanism.
    "pieces-merged": dict(partition_bytes=512, credit_bytes=2048, merge=True, fast_lane_bytes=256, exact3=False, adaptive=False),
    # One unmerged operation per bucket: the same tensors gloo sees under the reference hook.
    "whole-buckets": dict(partition_bytes="1GiB", merge=False, fast_lane_bytes=0, exact3=True, adaptive=False),
    # Library defaults, priorities taken from the model's parameter order.
    "defaults-model-priority": dict(use_model=True, exact3=False, adaptive=False),
    # 64 KiB pieces, merged: hundreds of pieces for a 26 MB layer.
    "64KiB-pieces": dict(partition_bytes="64KiB", merge=True, exact3=False, adaptive=False),
}
ALL_CONFIGS = ["pieces-merged", "whole-buckets", "defaults-model-priority"]


class Net(nn.Module):
    """A small MLP whose optional parts exercise DDP's corner cases."""

    def __init__(self, width=16, big=0, frozen=False, empty=False, branch=False, fp32_head=False):
        super().__init__()
        self.has_empty = empty
        self.has_frozen = frozen
        self.has_branch = branch
        self.has_big = big > 0
        self.fp32_head = fp32_head
        if empty:
            # Used at the input (see forward), so its gradient is ready last.
            self.empty_first = nn.Parameter(torch.empty(0))
        self.fc1 = nn.Linear(IN_FEATURES, width)
        if frozen:
            self.frozen = nn.Linear(width, width)
            self.frozen.requires_grad_(False)
        self.fc2 = nn.Linear(width, width)
        if empty:
            self.empty_mid = nn.Parameter(torch.empty(0, 3))
        if branch:
            self.branch = nn.Linear(width, width)
        if big:
            self.up = nn.Linear(width, big)
            self.big = nn.Linear(big, big)
            self.down = nn.Linear(big, width)
        self.head = nn.Linear(width, OUT_FEATURES)

    def forward(self, x, use_branch=True):
        if self.has_empty:
            # Used at the input: its gradient is ready last, so with tiny buckets DDP gives it
            # a bucket of its own, with zero elements.
            x = x + self.empty_first.sum()
        h = torch.tanh(self.fc1(x))
        if self.has_frozen:
            h = torch.tanh(self.frozen(h))
        h = torch.tanh(self.fc2(h))
        if self.has_empty:
            h = h + self.empty_mid.sum()
        if self.has_branch and use_branch:
            h = h + torch.tanh(self.branch(h))
        if self.has_big:
            h = h + self.down(torch.tanh(self.big(torch.tanh(self.up(h)))))
        if self.fp32_head:
            h = h.float()
        return self.head(h)


def _batch(rank, step, micro, dtype):
    g = torch.Generator().manual_seed(100_003 * rank + 101 * step + micro)
    x = torch.randn(BATCH, IN_FEATURES, generator=g).to(dtype)
    y = torch.randn(BATCH, OUT_FEATURES, generator=g)
    return x, y


def _train(ddp, rank, spec):
    """Run spec["steps"] optimizer steps; return the gradients of the last one (cloned)."""
    dtype = DTYPES[spec["dtype"]]
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    unused_at = set(spec.get("branch_unused_at", ()))
    micro_batches = spec.get("no_sync", 0)
    for step in range(spec["steps"]):
        opt.zero_grad()
        kwargs = {"use_branch": step not in unused_at} if spec["model"].get("branch") else {}

        def backward(micro):
            x, y = _batch(rank, step, micro, dtype)
            loss = (ddp(x, **kwargs).float() - y).pow(2).mean()
            loss.backward()

        for micro in range(micro_batches):
            with ddp.no_sync():
                backward(micro)
        backward(micro_batches)
        if step == spec["steps"] - 1:
            grads = [None if p.grad is None else p.grad.detach().clone() for p in ddp.module.parameters()]
        opt.step()
    return grads


def _digest(tensors):
    sha = hashlib.sha1()
    for t in tensors:
        sha.update(b"None" if t is None else t.detach().float().contiguous().numpy().tobytes())
    return sha.hexdigest()


def _compare(ours, ref):
    """(all bit-identical, largest relative norm difference) over matching tensors."""
    equal, worst = True, 0.0
    for a, b in zip(ours, ref):
        if a is None or b is None:
            if (a is None) != (b is None):
                return False, math.inf
            continue
        if a.dtype != b.dtype or a.shape != b.shape:
            return False, math.inf
        if not torch.equal(a, b):
            equal = False
            a64, b64 = a.double(), b.double()
            scale = max(b64.norm().item(), 1e-30)
            worst = max(worst, (a64 - b64).norm().item() / scale)
    return equal, worst


def _build(spec):
    torch.manual_seed(1234)
    model = Net(**spec["model"])
    model.to(DTYPES[spec["dtype"]])
    if spec["model"].get("fp32_head"):
        model.head.float()
    return model


def _ddp(model, spec, process_group=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(copy.deepcopy(model), process_group=process_group, **spec.get("ddp", {}))


def _run_specs(rank, world_size, specs, process_group=None):
    """Train the reference and every config of every spec; return comparisons per config."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import bytescheduler.pytorch as bsp

    results = []
    for spec in specs:
        model = _build(spec)
        ref = _ddp(model, spec, process_group)
        # allreduce_hook's state is the process group (None: the default group).
        ref.register_comm_hook(process_group, allreduce_hook)
        ref_grads = _train(ref, rank, spec)
        ref_params = [p.detach().clone() for p in ref.module.parameters()]
        out = {"name": spec["name"], "ref_digest": _digest(ref_params + ref_grads), "configs": {}}
        for config_name in spec["configs"]:
            options = dict(CONFIGS[config_name])
            options.pop("exact3")
            use_model = options.pop("use_model", False)
            ddp = _ddp(model, spec, process_group)
            state = bsp.ScheduledHookState(
                process_group=process_group,
                timeout=TIMEOUT,
                model=ddp.module if use_model else None,
                **options,
            )
            ddp.register_comm_hook(state, bsp.scheduled_allreduce_hook)
            try:
                grads = _train(ddp, rank, spec)
            finally:
                state.close()
            params = [p.detach().clone() for p in ddp.module.parameters()]
            params_equal, params_rel = _compare(params, ref_params)
            grads_equal, grads_rel = _compare(grads, ref_grads)
            out["configs"][config_name] = {
                "params_equal": params_equal,
                "params_rel": params_rel,
                "grads_equal": grads_equal,
                "grads_rel": grads_rel,
                "digest": _digest(params + grads),
                "stats": dict(state.scheduler.stats),
                "group_size": state.world_size,
                "bucket_bytes": _bucket_bytes(ddp),
                "none_grads": [i for i, g in enumerate(grads) if g is None],
                "ref_none_grads": [i for i, g in enumerate(ref_grads) if g is None],
            }
        results.append(out)
    return results


def _bucket_bytes(ddp):
    """DDP's own record of its (rebuilt) bucket sizes in bytes."""
    data = ddp._get_ddp_logging_data()
    text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(size) for size in str(text).split(",") if size.strip()]


def _tolerance(dtype_name):
    if dtype_name == "fp32":
        return 1e-6
    # Different summation orders of 3 addends differ by a few roundings per element; after a
    # few momentum steps a relative norm error of a handful of epsilons is still agreement.
    return 8 * torch.finfo(DTYPES[dtype_name]).eps


def _check(results, specs, world_size, min_pieces=None):
    """Assert the comparisons of every rank: exactness/tolerance, ranks agree, the hook ran."""
    for index, spec in enumerate(specs):
        per_rank = [r[index] for r in results]
        assert len({r["ref_digest"] for r in per_rank}) == 1, f"{spec['name']}: reference differs across ranks"
        for config_name in spec["configs"]:
            where = f"{spec['name']} / {config_name} on {world_size} ranks"
            got = [r["configs"][config_name] for r in per_rank]
            for rank, c in enumerate(got):
                assert c["stats"]["operations"] > 0, f"{where}: rank {rank}: the hook never communicated"
                assert c["group_size"] == world_size, f"{where}: rank {rank}: group size {c['group_size']}"
                assert c["none_grads"] == c["ref_none_grads"], (
                    f"{where}: rank {rank}: parameters without gradient {c['none_grads']}, "
                    f"reference {c['ref_none_grads']}"
                )
                if min_pieces is not None:
                    assert c["stats"]["pieces"] >= min_pieces.get(config_name, 0), (
                        f"{where}: rank {rank}: only {c['stats']['pieces']} pieces"
                    )
            assert len({c["digest"] for c in got}) == 1, f"{where}: ranks ended with different parameters"
            c = got[0]
            if world_size == 2 or CONFIGS[config_name]["exact3"]:
                assert c["grads_equal"], f"{where}: gradients differ from allreduce_hook (rel {c['grads_rel']:.3g})"
                assert c["params_equal"], f"{where}: parameters differ from allreduce_hook (rel {c['params_rel']:.3g})"
            else:
                tol = _tolerance(spec["dtype"])
                assert c["grads_rel"] <= tol, f"{where}: gradients differ by relative {c['grads_rel']:.3g} > {tol}"
                assert c["params_rel"] <= tol, f"{where}: parameters differ by relative {c['params_rel']:.3g} > {tol}"


SMALL_BUCKETS = {"bucket_cap_mb": 0.0005}  # 500 B: several buckets even for the small model


# --------------------------------------------------------------------------- 1. dtypes


def _dtype_specs():
    specs = []
    for dtype in DTYPES:
        specs.append(dict(name=dtype, dtype=dtype, model={"width": 24}, ddp=SMALL_BUCKETS, steps=3,
                          configs=ALL_CONFIGS))
    # fp16 body with an fp32 head: DDP buckets per dtype; the hook must not fuse across dtypes.
    specs.append(dict(name="fp16+fp32-head", dtype="fp16", model={"width": 24, "fp32_head": True},
                      ddp=SMALL_BUCKETS, steps=3, configs=ALL_CONFIGS))
    return specs


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp32_fp16_bf16_gradients_match_allreduce_hook(world_size):
    # gloo on CPU reduces all three dtypes (torch's own allreduce_hook works for them: the
    # reference run below would raise otherwise), so ours must match it.
    specs = _dtype_specs()
    results = run_ranks(_run_specs, world_size, args=(specs,), deadline=150)
    _check(results, specs, world_size)
    for r in results:
        for case in r:
            # The small partition really split the buckets.
            split, whole = (case["configs"][name]["stats"]["pieces"] for name in ("pieces-merged", "whole-buckets"))
            assert split > whole, (case["name"], split, whole)


# --------------------------------------------------------------------------- 2.-6. DDP features


def _feature_specs():
    return [
        # 2. zero-size parameters (1-D and 2-D), used in forward.
        dict(name="zero-size", dtype="fp32", model={"width": 16, "empty": True}, ddp=SMALL_BUCKETS,
             steps=3, configs=ALL_CONFIGS),
        # 3. a frozen layer in the middle of the model.
        dict(name="frozen", dtype="fp32", model={"width": 16, "frozen": True}, ddp=SMALL_BUCKETS,
             steps=3, configs=ALL_CONFIGS),
        # 4. a branch unused in some iterations (the same ones on every rank).
        dict(name="find-unused", dtype="fp32", model={"width": 16, "branch": True},
             ddp={**SMALL_BUCKETS, "find_unused_parameters": True}, branch_unused_at=(1, 2),
             steps=4, configs=ALL_CONFIGS),
        # 5. gradient accumulation: 3 micro-batches under no_sync, then one synced backward.
        dict(name="no-sync", dtype="fp32", model={"width": 16}, ddp=SMALL_BUCKETS, no_sync=3,
             steps=3, configs=ALL_CONFIGS),
        # 6. static graph (buckets are rebuilt after the first iteration).
        dict(name="static-graph", dtype="fp32", model={"width": 16, "frozen": True},
             ddp={**SMALL_BUCKETS, "static_graph": True}, steps=4, configs=ALL_CONFIGS),
        # gradients that are views into the bucket the hook averages in place.
        dict(name="grad-as-bucket-view", dtype="fp32", model={"width": 16, "branch": True},
             ddp={**SMALL_BUCKETS, "gradient_as_bucket_view": True}, steps=3, configs=ALL_CONFIGS),
        # everything at once, one bucket per parameter (10 B cap), a zero-size one among them.
        dict(name="all-features", dtype="fp32",
             model={"width": 16, "empty": True, "frozen": True, "branch": True},
             ddp={"bucket_cap_mb": 0.00001, "find_unused_parameters": True}, branch_unused_at=(0, 2),
             no_sync=2, steps=4, configs=ALL_CONFIGS),
    ]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_features_match_allreduce_hook(world_size):
    specs = _feature_specs()
    results = run_ranks(_run_specs, world_size, args=(specs,), deadline=150)
    _check(results, specs, world_size)
    by_name = {spec["name"]: i for i, spec in enumerate(specs)}
    for r in results:
        frozen = r[by_name["frozen"]]["configs"]["whole-buckets"]
        # fc1.weight, fc1.bias, frozen.weight, frozen.bias, ...: the frozen layer has no grad.
        assert frozen["none_grads"] == [2, 3], frozen["none_grads"]
        for config_name, c in r[by_name["zero-size"]]["configs"].items():
            # The case is only meaningful if DDP really handed the hook an empty bucket.
            assert 0 in c["bucket_bytes"] and len(c["bucket_bytes"]) >= 3, (config_name, c["bucket_bytes"])


# --------------------------------------------------------------------------- 7. bucket sizes

BIG = 2560  # nn.Linear(2560, 2560): 6.55 M fp32 parameters, 26.2 MB


def _bucket_specs():
    return [
        dict(name=f"bucket_cap_mb={cap}", dtype="fp32", model={"width": 16, "big": BIG},
             ddp={"bucket_cap_mb": cap}, steps=3, configs=["64KiB-pieces", "whole-buckets"])
        for cap in (0.001, 100)
    ]


@pytest.mark.parametrize("world_size", [2, 3])
def test_bucket_sizes_1kb_to_100mb_with_a_26mb_layer(world_size):
    specs = _bucket_specs()
    results = run_ranks(_run_specs, world_size, args=(specs,), deadline=170)
    big_bytes = (BIG * BIG + BIG) * 4
    steps = specs[0]["steps"]
    # The big layer alone is at least ceil(26.2 MB / 64 KiB) = 401 pieces per step.
    _check(results, specs, world_size, min_pieces={"64KiB-pieces": steps * -(-big_bytes // (64 * 1024))})
    for r in results:
        tiny, large = (r[i]["configs"]["whole-buckets"]["bucket_bytes"] for i in range(2))
        # DDP's first iteration uses one bucket; from the third on, the rebuilt ones count.
        assert len(tiny) >= 6 and min(tiny) <= 1024, tiny  # 1 KB cap: about one per layer
        assert len(large) == 1 and large[0] >= big_bytes, large  # 100 MB: the whole model


# --------------------------------------------------------------------------- 8. another process group


SUBGROUP_CONFIGS = ["pieces-merged", "whole-buckets"]


def _subgroup(rank, world_size, members):
    import torch.distributed as dist

    import bytescheduler.pytorch as bsp

    pg = dist.new_group(members)
    out = {"member": rank in members}
    if rank in members:
        specs = [dict(name=f"group {members}", dtype="fp32", model={"width": 16}, ddp=SMALL_BUCKETS,
                      steps=3, configs=SUBGROUP_CONFIGS)]
        out["results"] = _run_specs(rank, world_size, specs, process_group=pg)
        out["specs"] = specs
    else:
        # Creating a state is collective over the default group: a process outside the group
        # creates one too, in the same order as the members, passing what dist.new_group
        # returned to it (documented on ScheduledHookState and ProcessGroups.claim).
        out["non_member_error"] = None
        try:
            for config_name in SUBGROUP_CONFIGS:
                options = {k: v for k, v in CONFIGS[config_name].items() if k not in ("exact3", "use_model")}
                state = bsp.ScheduledHookState(process_group=pg, timeout=TIMEOUT, **options)
                state.close()
        except Exception as error:  # noqa: BLE001 - reported by the parent
            out["non_member_error"] = f"{type(error).__name__}: {error}"
    # dist.new_group names groups by a per-process counter, so every process must have made
    # the same number of new_group calls, or the next group created on all ranks pairs up the
    # wrong stores. Compare the counter (torch's own bookkeeping) before trying.
    counts = [None] * world_size
    dist.all_gather_object(counts, dist.distributed_c10d._world.group_count)
    out["group_counts"] = counts
    out["world_sum"] = None
    if len(set(counts)) == 1:
        check = dist.new_group(timeout=timedelta(seconds=20))
        t = torch.ones(3)
        dist.all_reduce(t, group=check)
        out["world_sum"] = t.tolist()
    return out


@pytest.mark.parametrize("members", [[0, 1], [1, 2]], ids=["members-0-1", "members-1-2"])
def test_process_group_other_than_default(members):
    world_size = 3
    out = run_ranks(_subgroup, world_size, args=(members,), deadline=120)
    member_out = [o for o in out if o["member"]]
    specs = member_out[0]["specs"]
    _check([o["results"] for o in member_out], specs, len(members))
    outsider = next(rank for rank in range(world_size) if rank not in members)
    assert out[outsider]["non_member_error"] is None, (
        f"rank {outsider} is not in process_group {members}; it must take part in creating the "
        f"members' states (collective over the default group), but it raised: "
        f"{out[outsider]['non_member_error']}"
    )
    counts = out[0]["group_counts"]
    assert len(set(counts)) == 1, (
        f"ranks made different numbers of dist.new_group calls {counts}: the members created "
        "bytescheduler's groups without the non-member, so the next group created on all ranks "
        "would pair up the wrong processes"
    )
    assert all(o["world_sum"] == [3.0, 3.0, 3.0] for o in out)
