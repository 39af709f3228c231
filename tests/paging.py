"""Test helper: contiguous per-row caches laid out as a paged pool with a shuffled block table."""
import torch


def to_pages(*caches, page: int = 64, seed: int = 0, spare: int = 3):
    """caches: [R, Hkv, S, D] tensors (any strides) -> (pools [P, Hkv, page, D] each, table [R, W]
    int32) with W = ceil(S / page): the rows' pages land at shuffled places among `spare` pages
    that no row holds, every slot past S and every spare page NaN. The pools are slices of a
    larger tensor (non-trivial strides) and the table a column slice of a wider one, so a kernel
    that ignores the table or assumes contiguity reads NaN."""
    R, H, S, D = caches[0].shape
    W = -(-S // page)
    n = R * W + spare
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen)[:R * W].view(R, W)
    pools = []
    for c in caches:
        big = torch.full((2, n, page, H, D), float("nan"), dtype=c.dtype, device=c.device)
        pool = big[1].transpose(1, 2)                                   # [n, H, page, D]
        padded = torch.full((R, H, W * page, D), float("nan"), dtype=c.dtype, device=c.device)
        padded[:, :, :S] = c
        pool[perm.flatten().to(c.device)] = padded.view(R, H, W, page, D).transpose(1, 2).reshape(R * W, H, page, D)
        pools.append(pool)
    wide = torch.zeros(R, W + 2, dtype=torch.int32)
    wide[:, :W] = perm.int()
    return (*pools, wide[:, :W].to(caches[0].device))


def from_pages(pool: torch.Tensor, table: torch.Tensor, S: int) -> torch.Tensor:
    """The rows' slots [0, S) of a paged pool back as [R, Hkv, S, D]."""
    R, W = table.shape
    x = pool[table.long()]                                              # [R, W, H, page, D]
    return x.transpose(1, 2).reshape(R, pool.shape[1], W * pool.shape[2], pool.shape[3])[:, :, :S]


def layer_pages(*caches, page: int = 16, seed: int = 0):
    """[L, R, Hkv, S, D] caches -> (pools [L, P, Hkv, page, D] each, table [R, W]): `to_pages`
    per layer with one table (a page size dividing S, so a row spans exactly S slots)."""
    S = caches[0].shape[3]
    page = next(p for p in (page, 8, 4, 2, 1) if S % p == 0)
    per_layer = [to_pages(*(c[i] for c in caches), page=page, seed=seed) for i in range(caches[0].shape[0])]
    pools = [torch.stack([layer[j] for layer in per_layer]) for j in range(len(caches))]
    return (*pools, per_layer[0][-1])


def layer_from_pages(pool: torch.Tensor, table: torch.Tensor, S: int) -> torch.Tensor:
    return torch.stack([from_pages(p, table, S) for p in pool])
