"""Read a `.bin/.idx` pair with megatron-core's own IndexedDataset code.

Usage: python megatron_read.py INDEXED_DATASET_PY PREFIX...

megatron-core's `indexed_dataset.py` imports torch and megatron-core's package (which needs
torch and more), none of which the local read path uses: it reads the index with `struct` and
numpy and memory-maps the tokens with numpy. So this loads the real file on its own, with
stand-ins for what it imports (a torch whose Dataset is `object`, object storage that is never
used, a no-op logger), and prints, per prefix, `<sequences> <documents> <blake3-free checksum>`
plus every sequence as a JSON list on stdout for the caller to compare.
"""

import importlib.util
import json
import sys
import types


def stub(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


torch = stub("torch", Tensor=object)
torch.utils = stub("torch.utils")
torch.utils.data = stub("torch.utils.data", Dataset=object)
stub("megatron")
stub("megatron.core")
stub("megatron.core.datasets")
never = lambda *a, **k: False  # noqa: E731
stub(
    "megatron.core.datasets.object_storage_utils",
    S3Config=object,
    ObjectStorageConfig=object,
    cache_index_file=never,
    dataset_exists=never,
    get_index_cache_path=never,
    get_object_storage_access=never,
    is_object_storage_path=never,
    parse_s3_path=never,
)
stub("megatron.core.msc_utils", MultiStorageClientFeature=type("F", (), {"is_enabled": staticmethod(never)}))
stub("megatron.core.utils", log_single_rank=lambda *a, **k: None)

spec = importlib.util.spec_from_file_location("megatron.core.datasets.indexed_dataset", sys.argv[1])
indexed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(indexed)

for prefix in sys.argv[2:]:
    ds = indexed.IndexedDataset(prefix)
    print(json.dumps({"prefix": prefix, "documents": len(ds.document_indices) - 1,
                      "sequences": [ds[i].tolist() for i in range(len(ds))]}))
