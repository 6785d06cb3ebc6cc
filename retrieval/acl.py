"""Who is asking, and which chunk versions their groups admit.

A chunk version is visible to a caller if it is public (an empty or null ACL) or shares
one of the caller's groups. Search, answers and lineage all decide with :func:`acl_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True)
class Principal:
    name: str
    groups: frozenset[str] = frozenset()


ANONYMOUS = Principal("anonymous")


def acl_mask(acl: pa.Array | pa.ChunkedArray, groups: frozenset[str]) -> np.ndarray:
    """Rows a caller in ``groups`` may see: public (empty or null ACL) or sharing a group."""
    arr = acl.combine_chunks() if isinstance(acl, pa.ChunkedArray) else acl
    mask = np.asarray(pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False) == 0)
    if groups and len(arr):
        flat = pc.list_flatten(arr)
        parents = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
        hit = pc.fill_null(pc.is_in(flat, value_set=pa.array(sorted(groups))), False)
        mask[parents[hit.to_numpy(zero_copy_only=False)]] = True
    return mask
