"""Statistical tests split into shards that pytest-xdist can run in parallel: each shard saves
its tally, and the shard that completes the set gets every shard's tally merged, so the test
keeps the power of all the samples together."""
import fcntl
import json
import os
from collections import Counter


def shared_dir(tmp_path_factory, name: str) -> str:
    """A directory that every xdist worker of this pytest session sees (the session's base
    temporary directory; a worker's own is one level below it)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = os.path.join(str(base), name)
    os.makedirs(path, exist_ok=True)
    return path


def merge_when_complete(directory: str, shard: int, n_shards: int, tally: Counter):
    """Save shard `shard`'s tally (string keys); return the sum of all `n_shards` tallies if
    this call completes the set, else None. Exactly one shard of a session gets the sum."""
    with open(os.path.join(directory, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)      # released when the file closes
        with open(os.path.join(directory, f"shard{shard}.json"), "w") as f:
            json.dump(dict(tally), f)
        names = [n for n in os.listdir(directory) if n.startswith("shard") and n.endswith(".json")]
        if len(names) < n_shards:
            return None
        merged = Counter()
        for n in names:
            with open(os.path.join(directory, n)) as f:
                merged.update(json.load(f))
        return merged
