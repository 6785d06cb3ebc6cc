"""``streamrag index build`` settings: flags, else ``STREAMRAG_INDEX_BUILD_<OPTION>`` variables, else defaults."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from indexing.manifest import DEFAULT_GC_GRACE_S


class IndexBuildSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STREAMRAG_INDEX_BUILD_", frozen=True)

    lake: str = Field(description="the lake: path, file:// or s3://")
    index: str = Field(description="the index store: path, file:// or s3://")
    nlist: int | None = Field(None, ge=1, description="IVF lists (default about 4*sqrt(N))")
    lake_version: int | None = Field(None, ge=0, description="Delta version to index (default latest)")
    ray_address: str | None = Field(None, description="join a Ray cluster (implies executor ray)")
    executor: str = Field(
        "auto",
        pattern=r"^(auto|local|ray)$",
        description="in-process while the vectors take ≤ 1/4 of memory (auto), local or ray",
    )
    iterations: int = Field(20, ge=1, description="k-means iterations at most")
    seed: int = 1234
    shard_mb: float = Field(64.0, gt=0, description="target shard size in MB")
    codec: str = Field(
        "flat", pattern=r"^(flat|sq8|sq4|pq[1-9][0-9]*)$", description="how vectors are stored in the shards"
    )
    assign_nprobe: int | None = Field(
        None, ge=1, description="the smallest nprobe assignment is chosen for (default: serve's default nprobe)"
    )
    reuse_centroids: bool = Field(False, description="assign to the last build's centroids unless they drifted")
    drift_threshold: float = Field(0.10, ge=0, description="retrain above this quantization-error growth")
    max_delta: float = Field(
        0.10, ge=0, le=1, description="with reuse_centroids: build incrementally while at most this share changed"
    )
    full: bool = Field(False, description="with reuse_centroids: rewrite every shard even when a delta would do")
    keep: int | None = Field(None, ge=1, description="keep only the newest N versions (after gc_grace)")
    gc_grace: float = Field(DEFAULT_GC_GRACE_S, ge=0, description="seconds a replaced version is kept for readers")
    store_patience: float = Field(300.0, ge=0, description="seconds a started build retries an unreachable store")
    every: float | None = Field(None, gt=0, description="keep building: a new version every N seconds")
    tail_rows: int | None = Field(
        None, ge=1, description="keep building: a new version as soon as N chunk versions were committed since the last"
    )
    openlineage: str | None = None
