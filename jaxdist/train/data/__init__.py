"""The trainer's data: text prepared into token shards (`prepare`, `tokenize`), read through grain
as batches that are a pure function of (seed, step, row) (`shards`), and the configured source
(`sources`: shards, text prepared on the fly, or a synthetic stream).
"""

from jaxdist.train.data.shards import Loader, ShardData
from jaxdist.train.data.sources import CORPUS, SyntheticData, make

__all__ = ["CORPUS", "Loader", "ShardData", "SyntheticData", "make"]
