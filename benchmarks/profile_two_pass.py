"""Nsight Compute profile of the one-launch two-pass kernels past L2 (the TV without given
normalisers, `window_divergence`, and the mixture row, `ensemble_mix`): one call per case
inside cudaProfilerStart/Stop, after two warm-up calls, cold inputs (ncu flushes the caches
before each replay pass).

    ncu --clock-control none --profile-from-start off --set full --import-source yes \\
        -o $OUT/two_pass python3 benchmarks/profile_two_pass.py tv:64:4 greedy+mix:512:4 tv:256:1
    ncu --import $OUT/two_pass.ncu-rep --page source --csv --print-source sass > $OUT/two_pass_sass.csv
    python3 benchmarks/profile_two_pass.py --phases $OUT/two_pass_sass.csv

Cases (KIND:B:K): tv / kl (window_divergence without normalisers, KL and TV or KL only, P = 6
positions), greedy+mix / sample+mix (ensemble_mix with the mixture row); V = 32064, bf16.
`--phases` reads the per-instruction source page (SASS) and prints, per kernel, the runs of
instructions with one execution count (a loop body, the code run once per program, a spin
loop) with their shares of the executed instructions and of the warp-state samples.
"""
import argparse
import csv
import io
import sys

V = 32064


def run_case(case):
    """Build the inputs of one case and profile one call of it (after two warm-up calls)."""
    import torch

    from tabed_engine.kernels import ensemble_mix as em
    from tabed_engine.kernels import window_divergence as wd
    kind, B, K = case.split(":")[0], *map(int, case.split(":")[1:])
    g = torch.Generator().manual_seed(0)
    dev = "cuda"
    if kind in ("tv", "kl"):
        P = 6
        buf = (torch.randn(P, B, K + 1, V, generator=g) * 2).to(torch.bfloat16).to(dev)
        p, q = buf[:, :, 0].permute(1, 0, 2), buf[:, :, 1:].permute(1, 2, 0, 3)
        if kind == "tv" and not wd._tv_fused_taken(p, q):
            raise SystemExit(f"{case}: below the one-launch threshold")
        call = lambda: wd.window_divergence(p, q, tv=kind == "tv")
    elif kind in ("greedy+mix", "sample+mix"):
        logits = (torch.randn(B * K, V, generator=g) * 2).to(torch.bfloat16).to(dev)
        w = torch.full((B, K), 1.0 / K, device=dev)
        mix = torch.empty(B, V, device=dev)
        seed = torch.tensor([3], device=dev)
        offset = torch.tensor([0], device=dev)
        call = lambda: em.ensemble_mix(logits, w, greedy=kind == "greedy+mix", seed=seed, offset=offset,
                                       mixture_out=mix)
    else:
        raise SystemExit(f"unknown case kind {kind!r} (tv, kl, greedy+mix, sample+mix)")
    call()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled", case, flush=True)


def phase_runs(text):
    """Per kernel of an ncu source-page CSV (`text`): (name, warp instructions, samples,
    runs), a run being consecutive SASS instructions with the same execution count:
    [first address, last address (relative to the kernel's first), count, instructions,
    warp-state samples]."""
    out = []
    for block in text.split('"Kernel Name",')[1:]:
        name, body = block.split("\n", 1)
        rows = list(csv.reader(io.StringIO(body)))
        hdr = rows[0]
        data = [r for r in rows[1:] if len(r) == len(hdr)]
        ie = hdr.index("Instructions Executed")
        ws = hdr.index("Warp Stall Sampling (All Samples)")
        base = int(data[0][0], 16)
        runs = []
        for r in data:
            count, at, samples = float(r[ie] or 0), int(r[0], 16) - base, float(r[ws] or 0)
            if runs and runs[-1][2] == count:
                runs[-1][1] = at
                runs[-1][3] += 1
                runs[-1][4] += samples
            else:
                runs.append([at, at, count, 1, samples])
        out.append((name.strip(",").strip('"'), sum(r[2] * r[3] for r in runs), sum(r[4] for r in runs), runs))
    return out


def phases(path, min_share=0.01):
    """Print `phase_runs` of the CSV at `path`: each run's address range, count, length and
    shares of the kernel's executed instructions and samples (runs under min_share of both
    left out)."""
    for name, n_inst, n_samp, runs in phase_runs(open(path).read()):
        print(f"{name}: {n_inst:.0f} warp instructions, {n_samp:.0f} samples")
        for a0, a1, count, n, samples in runs:
            if n * count / n_inst >= min_share or samples / max(n_samp, 1) >= min_share:
                print(f"  {a0:#07x}-{a1:#07x}  executed {count:8.0f} x {n:4d} instructions: "
                      f"{100 * n * count / n_inst:5.1f}% of instructions, {100 * samples / max(n_samp, 1):5.1f}% of samples")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", help="KIND:B:K cases to profile, in order")
    ap.add_argument("--phases", metavar="CSV", help="summarise an ncu source-page CSV instead")
    args = ap.parse_args()
    if args.phases:
        phases(args.phases)
        return
    if not args.cases:
        ap.error("no cases given")
    for case in args.cases:
        run_case(case)


if __name__ == "__main__":
    sys.exit(main())
