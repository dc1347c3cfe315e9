// Package vllmsim simulates a vLLM 0.29 inference engine behind its
// OpenAI-compatible API, faithfully enough to measure a gateway in front of
// it: continuous batching under max-num-seqs, chunked prefill within a token
// budget, a paged KV cache with preemption by recomputation, automatic prefix
// caching, vLLM's fcfs and priority scheduling semantics, the 0.29 admission
// valves, streaming with usage, and vLLM's metric names. It runs no model:
// time is simulated by a cost model and text is drawn from a vocabulary.
//
// # Layers
//
// Scheduler is a pure, single-goroutine state machine over simulated time:
// Add and Abort change the request set, Step runs one engine iteration and
// returns its simulated duration with the tokens sampled, the sequences
// admitted, preempted and finished. It needs no HTTP and no clock, so tests
// drive it against hand-computed timelines.
//
// Server puts the OpenAI API in front of it. A driver goroutine steps the
// scheduler and releases each step's results when the wall clock reaches the
// step's end: simulated time = wall time since start × Config.TimeScale.
// When it falls behind, due steps run back to back, so the simulated timeline
// never depends on how fast the machine is; only delivery does.
//
// # Scheduling (one step, as vLLM v1's schedule())
//
//  1. Running sequences, in admission order, get the tokens they still need
//     — one for a decode, the rest of the prompt (capped by the budget and
//     --long-prefill-token-threshold) for a chunked prefill — out of a budget
//     of --max-num-batched-tokens. Decodes of running requests therefore
//     always go before new prefills.
//  2. When the KV cache cannot grow a running sequence, a victim is preempted
//     by recomputation: its blocks are freed, its computed tokens are lost,
//     and it returns to the front of the waiting queue. The victim is the
//     last admitted under fcfs and the worst (priority, arrival) under
//     priority. Its output so far is kept and recomputed with the prompt.
//  3. Only in a step without preemptions, the waiting queue's head is
//     admitted while fewer than --max-num-seqs run and budget remains, with
//     its prefix-cache hit, if its whole sequence fits in the free blocks
//     (vLLM's scheduler_reserve_full_isl, on by default). A head that does not
//     fit ends admission for the step: nobody is evicted for it. So a running
//     request is never preempted because a higher-priority one arrived, and
//     with max-num-seqs full a priority-0 chat waits like everyone else.
//  4. At the end of the step, every sequence whose tokens are all computed
//     samples one token; a sequence finishes on its end-of-sequence token
//     ("stop") or at max_tokens or max-model-len ("length"), and frees its
//     blocks.
//
// The waiting queue is in arrival order under fcfs, and ordered by
// (priority, arrival, admission order) under priority, lowest first. The KV
// cache has --num-gpu-blocks blocks of --block-size tokens, one of them
// vLLM's reserved null block.
//
// # Cost model
//
// A step takes
//
//	DecodeStepBase + DecodeStepPerSeq × (sequences in the batch)
//	               + (prefill tokens in the batch) / PrefillTokensPerSecond
//
// where prefill tokens are every computed token that is not a single-token
// decode: prompt chunks, and prompt plus output of a preempted sequence being
// recomputed. Prefix-cache hits are not computed and cost nothing. The
// defaults (10 ms, 0.1 ms, 10k tokens/s) are in the range of a 30B MoE model
// on one H100. A token sampled by a step is emitted at the step's end, so a
// request's time to first token is its queue time plus its prefill steps.
//
// # Tokenizer
//
// Tokenize is deterministic and needs no vocabulary file. At each position:
// a special token (<|im_start|>, <|im_end|>, <|endoftext|>) is one token; a
// single space before a non-space character is glued to the next token; a
// run of letters (ASCII letters or any non-ASCII rune) gives a token per 4
// letters; digits a token per 3; a newline is a token; other whitespace a
// token per run of up to 4 bytes; any other byte is a token of its own. English text comes out at roughly 4
// characters per token. A token's ID is the FNV-1a hash of its text modulo
// VocabSize (specials have fixed IDs). Chat requests are rendered with a
// ChatML template (tools first, then each message, then
// "<|im_start|>assistant\n"), which is prefix-stable: a conversation's next
// turn starts with the previous turn's prompt and answer, so it hits the
// prefix cache.
//
// # Prefix cache
//
// With --enable-prefix-caching (the default), each full block of a sequence
// is identified by a hash chained over all tokens up to its end (and the
// request's cache_salt). Admission reuses the longest run of cached blocks,
// but never the last prompt token. Freed blocks keep their hash until the
// free queue (LRU; a sequence's tail goes first) hands them out again.
// vllm:prefix_cache_queries_total and _hits_total count tokens, once per
// request at its first admission (vLLM counts again each time a blocked
// head is examined; the simulator does not). A response's
// usage.prompt_tokens_details.cached_tokens is its hit.
//
// # Output
//
// Output text is English-looking words (see FillerText), deterministic per
// request: the request's seed field, or else its order of arrival, with
// Config.Seed. The model stops on its own after a length drawn uniformly in
// [MeanOutputTokens/2, 3×MeanOutputTokens/2] (at least min_tokens+1), its
// last token being the end-of-sequence token (no text, counted in
// completion_tokens as vLLM does). ignore_eos (or Config.IgnoreEOS) makes it
// produce exactly max_tokens; the X-Sim-Output-Tokens header makes it stop
// after exactly that many.
//
// # API
//
// POST /v1/chat/completions and /v1/completions (streaming and not; n,
// max_tokens / max_completion_tokens, seed, ignore_eos, min_tokens,
// cache_salt, stream_options.include_usage and continuous_usage_stats),
// POST /v1/embeddings (float or base64, dimensions), GET /v1/models,
// POST /tokenize, GET /health, GET /version and GET /metrics. The request's
// priority is the X-Vllm-Priority header, else the body's priority field;
// under fcfs a non-zero priority is a 400, as in vLLM. Errors have vLLM's
// shape, {"error": {"message", "type", "param", "code"}}; a missing or wrong
// API key gets 401 {"error": "Unauthorized"}; --max-num-queued-reqs and
// --max-num-queued-tokens answer 503 with vLLM 0.29's messages.
//
// # Metrics
//
// GET /metrics uses vLLM's names and labels (engine, model_name):
// vllm:num_requests_running, vllm:num_requests_waiting,
// vllm:kv_cache_usage_perc, vllm:num_preemptions_total,
// vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total,
// vllm:prompt_tokens_total, vllm:generation_tokens_total,
// vllm:request_success_total{finished_reason},
// vllm:time_to_first_token_seconds, vllm:request_queue_time_seconds and
// vllm:e2e_request_latency_seconds. Durations are simulated seconds. One
// simulator-only series records what priority requests arrived with:
// vllm_sim:request_priority_total{priority,outcome}, priority the decimal
// value or "none" when the request carried none, outcome "accepted" or
// "rejected" (a non-zero priority on an fcfs engine); Server.ReceivedPriorities
// gives the same counts in process.
//
// # Fault injection
//
// Faults (for every request, set by Config or SetFaults) and the
// X-Sim-Fault-* headers (for one request) answer /v1 requests with an error
// status and Retry-After, delay them, cut streams after N chunks, or refuse
// connections for a while; SetRefuseConnections refuses connections until
// told otherwise.
package vllmsim
