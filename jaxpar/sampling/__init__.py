"""Generation in batches on the training layout: a preallocated key/value cache for B rows split by
the rules table, prefill of left-padded prompts, a jitted decode loop that stops each row at its end
tokens, and the token choice (greedy, temperature, top-k, top-p) drawn the same on every layout
(jaxpar.sampling.batched, jaxpar.sampling.choice); prompts from JSONL and completions back
(jaxpar.sampling.prompts)."""
