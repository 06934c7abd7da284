"""Data pipeline: tokenizers, Megatron .bin/.idx shards, preprocessing, the GPT training dataset.

Public entry points (import from the submodules; this package import stays light):

* :mod:`.tokenizers` -- ``Tokenizer``, ``load_tokenizer``, ``train_tokenizer``
* :mod:`.preprocess` -- ``preprocess(PreprocessOptions(...))``
* :mod:`.indexed` -- ``IndexedShard`` (validating reader), ``ShardWriter``, ``merge_shards``
* :mod:`.gpt_dataset` -- ``build_datasets``, ``GPTDataset``, ``micro_batches``
* :mod:`.prepare` -- ``prepare_data`` (the main job's first-use tokenization, cached)
"""
from ..paths import bundled

# The bundled English corpus (Wikipedia Vital Articles summaries, CC BY-SA 4.0; see its README),
# shipped inside the package so it exists for a regular install too.
BUNDLED_CORPUS = str(bundled("wiki_vital_en.jsonl.gz"))
