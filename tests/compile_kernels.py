"""Compile every Triton kernel launch for an NVIDIA sm_90 target, on a machine without a GPU.

The interpreter (how CPU CI runs the kernels) accepts programs the compiler rejects, e.g. a
name re-bound to a different shape inside a loop or a runtime branch. This script closes
that gap in two steps, run as separate processes by `tests/test_kernel_compile.py`:

    TRITON_INTERPRET=1 python tests/compile_kernels.py record launches.json
        calls every launcher (each op and mode, small shapes) and records each kernel launch
        without running it: argument types, constexpr values, launch options and the arguments a GPU launch
        would specialise as 16-divisible;
    python tests/compile_kernels.py compile launches.json
        compiles each distinct launch to PTX and cubin with Triton's CUDA backend
        (`triton.compile` on an `ASTSource`, target sm_90, ptxas included) as a GPU launch
        makes it (FAST math, bf16 dots, 16-divisible arguments: the variant with 16-byte
        loads).
"""
import inspect
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_PTR = {"float64": "*fp64", "float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "int64": "*i64", "int32": "*i32",
        "int8": "*i8", "uint8": "*u8", "bool": "*i1"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl")


def _arg_type(v):
    import torch
    if isinstance(v, torch.Tensor):
        return _PTR[str(v.dtype).replace("torch.", "")]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"unsupported kernel argument {type(v).__name__}")


def _divisible_by_16(v):
    """Whether a GPU launch would specialise this argument as 16-divisible (`tt.divisibility`):
    a tensor whose address is, or an integer (not a bool) that is."""
    import torch
    if isinstance(v, torch.Tensor):
        return v.data_ptr() % 16 == 0
    return isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0


def record(path):
    """Call every launcher under the interpreter, recording each launch (without running it)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "record runs under TRITON_INTERPRET=1"
    from triton.runtime.interpreter import InterpretedFunction

    launches = {}
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        params = list(inspect.signature(fn).parameters.values())
        bound = dict(zip([p.name for p in params], args))
        bound.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
        sig, consts, div16 = {}, {}, []
        for p in params:
            v = bound.get(p.name, p.default)
            if "constexpr" in str(p.annotation):
                sig[p.name] = "constexpr"
                consts[p.name] = v
            else:
                sig[p.name] = _arg_type(v)
                if _divisible_by_16(v):
                    div16.append(p.name)
        opts = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
        entry = {"module": fn.__module__, "name": fn.__name__, "signature": sig, "constexprs": consts,
                 "options": opts, "div16": div16}
        launches[json.dumps(entry, sort_keys=True)] = entry
        # not run: only the launch is wanted here (the kernel tests run each kernel under the
        # interpreter), and no launcher reads a kernel's output on the host (launches are
        # graph-safe), so the launches are the same; running them took ~45 s of ~47 s

    InterpretedFunction.run = recording
    try:
        _exercise()
    finally:
        InterpretedFunction.run = run
    with open(path, "w") as f:
        json.dump(list(launches.values()), f, indent=1)
    print(f"recorded {len(launches)} distinct launches")


def _exercise():
    """Every op in each of its modes, on small shapes (the kernels' constexpr branches)."""
    import torch

    from tabed_engine.kernels import (add_rms_norm, chain_verify, ensemble_mix, gemv, history_update, mix_topk,
                                      rope_kv_write, silu_mul, tree_attention, tree_grow, window_divergence)
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    V = 300
    for K in (1, 3):
        logits = torch.randn(2 * K, V, generator=g).to(bf)
        w = torch.full((2, K), 1.0 / K)
        seed, off = torch.tensor([1]), torch.tensor([0])
        for greedy in (True, False):
            for mix in (False, True):
                ensemble_mix.ensemble_mix(logits, w, greedy=greedy, seed=seed, offset=off, return_mixture=mix)
        # chunks of several pass-1 steps (many requests)
        for greedy in (True, False):
            ensemble_mix.ensemble_mix(torch.randn(2 * K, 9000, generator=g).to(bf), w, greedy=greedy, seed=seed,
                                      offset=off)
    ensemble_mix.ensemble_mix(logits, w, greedy=True, certified_out=torch.zeros(2, dtype=torch.int32))
    # a 16-divisible vocabulary and row stride, as at V = 32064: the GPU variant also
    # specialises the integers (masks constant over each 16-byte group)
    for K in (1, 2):
        wk = torch.full((2, K), 1.0 / K)
        for greedy in (True, False):
            ensemble_mix.ensemble_mix(torch.randn(2 * K, 1008, generator=g).to(bf), wk, greedy=greedy, seed=seed,
                                      offset=off)
        ensemble_mix.ensemble_mix(torch.randn(2 * K, 9008, generator=g).to(bf), wk, greedy=True)
    # the token into every view row (the draft loop's K > 1 steps)
    ensemble_mix.ensemble_mix(logits, w, greedy=True, view_tokens_out=torch.zeros(6, dtype=torch.int64))
    ensemble_mix.ensemble_mix(logits, w, greedy=False, seed=seed, offset=off, return_mixture=True,
                              view_tokens_out=torch.zeros(6, dtype=torch.int64))

    # the tree draft: children of a depth's frontier ([B*K, T, V] slices, weights per request or
    # per node; one chunk and several, a 16-divisible vocabulary), the bookkeeping's two kernels
    for K, V_t, w_t in ((1, 300, torch.ones(2, 1)), (2, 1008, torch.full((2, 3, 2), 0.5)),
                        (3, 5000, torch.full((2, 3), 1 / 3))):
        z = torch.randn(2 * K, 5, V_t, generator=g).to(bf)[:, 1:4]
        mix_topk.mix_topk(z, w_t, 2)
        mix_topk.mix_topk(z, w_t, 8, 0.7, plan=mix_topk.topk_plan(6, V_t, sms=4, splits=3))
        mix_topk.mix_topk(z, w_t, 3, seed=torch.tensor([1]), offset=torch.tensor([0]),
                          mixture_out=torch.zeros(2, 9, V_t), out_rows=torch.ones(2, 3, dtype=torch.long))
    from tabed_engine import TreeConfig
    from tabed_engine.ops.tree_grow import TreeState
    tcfg, K = TreeConfig(3, 2, 2), 2
    st = TreeState.empty(2, K, tcfg.nodes, tcfg.fed, tcfg.draft_rows, "cpu")
    tree_grow.tree_start(st.tokens, st.parents, st.score, st.fedpos, st.fed, st.ids, st.pos, st.bits,
                         torch.ones(2 * K, 2, dtype=torch.long), torch.full((2 * K,), 5), pad=2, width=2)
    state = (st.tokens, st.parents, st.score, st.fedpos, st.fed, st.ids, st.bits)
    for n_nodes, n_fed, T, k, last in ((1, 1, 1, 2, False), (3, 3, 2, 2, True)):
        tree_grow.tree_grow(*state, torch.ones(2, T, k, dtype=torch.long), -torch.rand(2, T, k, generator=g), pad=2,
                            n_nodes=n_nodes, n_fed=n_fed, width=2, last=last)

    p = torch.randn(1, 3, V, generator=g).to(bf)
    q = torch.randn(1, 2, 3, V, generator=g).to(bf)
    grid = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    window_divergence.window_divergence(p, q)
    window_divergence.window_divergence(p, q, tv=False)
    window_divergence.window_divergence(p, q, grid=grid)
    # the other two grid tile shapes (by B * P * G): 8-vector and 16-vector tiles
    window_divergence.window_divergence(p, q, grid=torch.rand(60, 2, generator=g))
    q4 = torch.randn(1, 4, 3, V, generator=g).to(bf)
    window_divergence.window_divergence(p, q4, grid=torch.rand(286, 4, generator=g))
    # the one-pass kernels with one view per program (few rows) and K views per program (many),
    # K = 1, 2, 4 (K = 1: two 16-byte groups per thread slot)
    for B, qk in ((1, q[:, :1]), (1, q), (8, q4)):
        pw = torch.randn(B, 3, 9008, generator=g).to(bf)
        qw = torch.randn(B, qk.shape[1], 3, 9008, generator=g).to(bf)
        window_divergence.window_divergence(pw, qw, tv=False)
        window_divergence.window_divergence(pw, qw, p_lse=torch.logsumexp(pw.float(), -1),
                                            q_lse=torch.logsumexp(qw.float(), -1))

    B, gamma = 2, 3
    plog = torch.randn(B, gamma + 1, V, generator=g)
    drafted = plog[:, :gamma].argmax(-1)
    chain_verify.chain_verify(drafted, None, plog.to(bf), greedy=True)
    chain_verify.chain_verify(drafted, None, plog.to(bf), greedy=True, lse_out=torch.zeros(B, gamma + 1))
    probs = torch.softmax(plog, -1)
    chain_verify.chain_verify(drafted, probs[:, :gamma].contiguous(), probs, greedy=False,
                              uniforms=torch.rand(B, gamma + 1, generator=g))

    from tabed_engine.ops.history_update import POLICY_DIV, POLICY_GRID, POLICY_HEDGE
    Bh, K, P, C = 1, 2, 3, 16
    for policy in (POLICY_DIV, POLICY_HEDGE, POLICY_GRID):
        G = 3 if policy == POLICY_GRID else 0
        history_update.history_update(
            torch.rand(Bh, K, P), torch.zeros(Bh, G, P, dtype=torch.bool) if G else None,
            torch.rand(Bh, G, P) if G else None, torch.tensor([1]), torch.zeros(Bh, dtype=torch.long),
            torch.zeros(Bh, C, dtype=torch.bool), torch.zeros(Bh, K, C), torch.zeros(Bh, G, C),
            torch.zeros(Bh, G, C), grid if G else None, policy=policy, window=0, temperature=1.0, clip=1.0,
            all_positions=policy == POLICY_HEDGE)
    G = history_update.GRID_SLICE + 5   # w-grid over several programs per request, the last folding
    for window in (0, 2):
        history_update.history_update(
            torch.rand(Bh, K, P), torch.zeros(Bh, G, P, dtype=torch.bool), torch.rand(Bh, G, P), torch.tensor([1]),
            torch.zeros(Bh, dtype=torch.long), torch.zeros(Bh, C, dtype=torch.bool), torch.zeros(Bh, K, C),
            torch.zeros(Bh, G, C), torch.zeros(Bh, G, C), torch.rand(G, K), policy=POLICY_GRID, window=window,
            temperature=1.0, clip=1.0, all_positions=False)

    R, N, H, Hkv, D, S = 1, 3, 4, 2, 16, 40
    qa = torch.randn(R, N, H, D, generator=g).to(bf)
    kc = torch.randn(3, Hkv, 64, D, generator=g).to(bf)          # pages of 64 slots
    vc = torch.randn(3, Hkv, 64, D, generator=g).to(bf)
    table = torch.tensor([[2]], dtype=torch.int32)               # [R, S / 64]
    lengths = torch.tensor([20], dtype=torch.int32)
    mask = torch.tensor([[1, 3, 5]], dtype=torch.int64)
    for splits in (1, 2, 3):
        tree_attention.tree_attention(qa, kc, vc, table, lengths, mask, num_splits=splits)
        tree_attention.tree_attention(qa[:, :1], kc, vc, table, lengths, mask[:, :1], num_splits=splits)  # one query
        tree_attention.tree_attention(qa, kc, vc, table, lengths, causal=True, num_splits=splits)  # a prompt chunk
    tree_attention.tree_attention(qa, kc, vc, table, lengths, mask, invariant=True, paths=True)  # a tree's paths

    x = torch.randn(3, 64, generator=g).to(bf)
    add_rms_norm.add_rms_norm(x, x.clone(), torch.ones(64, dtype=bf), 1e-6)
    add_rms_norm.add_rms_norm(x, None, torch.ones(64, dtype=bf), 1e-6)
    silu_mul.silu_mul(torch.randn(3, 2 * 1500, generator=g).to(bf))

    qkv = torch.randn(1, 2, (H + 2 * Hkv) * D, generator=g).to(bf)
    cs = torch.randn(1, 2, D, generator=g)
    rope_kv_write.rope_kv_write(qkv, cs, cs, kc, vc, table, lengths, H, Hkv)
    # the fresh prefill: into cache row `rows`, dense k/v out, q in SDPA's [R, H, T, D] layout,
    # a prefill-sized R * T (the larger head tile)
    Hp, Tp, Dp = 16, 260, 128
    kp, vp = torch.zeros(2, 11, Hp, 64, Dp, dtype=bf).unbind(0)
    ptable = torch.arange(1, 11, dtype=torch.int32).view(2, 5)
    k_out, v_out = torch.zeros(2, 1, Hp, Tp, Dp, dtype=bf).unbind(0)
    qkv = torch.randn(1, Tp, 3 * Hp * Dp, generator=g).to(bf)
    cs = torch.randn(1, Tp, Dp, generator=g)
    rope_kv_write.rope_kv_write(qkv, cs, cs, kp, vp, ptable, torch.zeros(1, dtype=torch.int32), Hp, Hp,
                                out=torch.empty(1, Hp, Tp, Dp, dtype=bf).transpose(1, 2), rows=torch.tensor([1]),
                                k_out=k_out, v_out=v_out)

    for K in (300, 1024):       # ragged and whole K tiles
        w, b = torch.randn(40, K, generator=g).to(bf), torch.randn(40, generator=g).to(bf)
        gemv.gemv(torch.randn(1, K, generator=g).to(bf), w, b)
        gemv.gemv(torch.randn(1, 2 * K, generator=g).to(bf), w, gated=True)
        gemv.gemv_rows(torch.randn(6, K, generator=g).to(bf), w, b)
    gemv.gemv_rows(torch.randn(3, 512, generator=g).to(bf), torch.randn(20000, 512, generator=g).to(bf))  # wide N
    for N in (80, 4096):        # the SiLU gate in the epilogue, two block configs
        gemv.gemv_rows(torch.randn(4, 300, generator=g).to(bf), torch.randn(N, 300, generator=g).to(bf), glu=True)
    x, w = torch.randn(40, 64, generator=g).to(bf), torch.randn(64, 64, generator=g).to(bf)
    for M in (20, 40):          # 32- and 64-row tiles: each rule's config (tiny shapes), a sweep's extremes
        rules = [gemv._dot_config(N, K, gemv.dot_block_m(M)) for N, K in ((768, 3072), (6144, 768), (4096, 4096),
                                                                          (32064, 4096))]
        for config in dict.fromkeys(rules + [(128, 64, 8, 5), (16, 512, 2, 2)]):
            gemv.gemv_rows(x[:M], w, config=config)
            gemv.gemv_rows(x[:M], w, glu=True, config=config)
    x, w = torch.randn(40, 256, generator=g).to(bf), torch.randn(64, 256, generator=g).to(bf)
    for config in ((64, 64, 4, 3, 2), (128, 64, 8, 4, 4)):   # K split over programs, the partials folded
        gemv.gemv_rows(x, w, config=config)
        gemv.gemv_rows(x, w, glu=True, config=config)


def compile_all(path):
    """Compile every recorded launch for sm_90; print one line each, exit 1 on any failure."""
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compile runs without the interpreter"
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with open(path) as f:
        launches = json.load(f)
    # the recording ran on the CPU: compile each launch as a GPU makes it (fast exp2/log2
    # through inline PTX, bf16/fp16 dots, programmatic dependent launch, the arguments it
    # specialises as 16-divisible - aligned tensors, integers such as V or a row stride: the
    # variant with vectorised loads - and the programs that wait for others of the launch,
    # which the interpreter cannot run). One variant a launch: the compile errors the
    # interpreter misses (shapes re-bound in loops or branches) do not depend on it.
    gpu = {"FAST": True, "FAST_MATH": True, "DOT_FP32": False, "PDL": True, "WAIT": True}
    launches = [dict(e, constexprs={k: gpu.get(k, v) for k, v in e["constexprs"].items()}) for e in launches]
    failed = 0
    for e in launches:
        fn = getattr(importlib.import_module(e["module"]), e["name"])
        try:
            attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(e["signature"])
                     if name in e["div16"]}
            src = ASTSource(fn=fn, signature=e["signature"], constexprs=e["constexprs"], attrs=attrs)
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=e["options"])
            assert kernel.asm.get("cubin"), "no cubin"
            print(f"ok   {e['name']} {e['constexprs']} div16={e['div16']}")
        except Exception as exc:  # report every failure, not just the first
            failed += 1
            msg = str(exc).strip().splitlines()
            print(f"FAIL {e['name']} {e['constexprs']}: {type(exc).__name__}: {' | '.join(msg[-6:])}")
    print(f"{len(launches) - failed}/{len(launches)} compiled for sm_90")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    record(path) if mode == "record" else compile_all(path)
