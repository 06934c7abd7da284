"""Moving models between megafixed and other stacks.

``hf``: export a trained run as a standard transformers architecture (Llama, Arcee, Starcoder2 or
StableLM, whichever reproduces the backbone exactly) and import a transformers Llama into a
megafixed learned-interface checkpoint. What a verb needs to find a trained model
(its run directory, tag, config and tokenizer) is ``megafixed.train.run_source``, beneath interop.
"""
