package vllmsim

import (
	"errors"
	"fmt"
	"net"
	"time"
)

// Policy is a scheduling policy, as vLLM's --scheduling-policy.
type Policy string

// Scheduling policies.
const (
	// PolicyFCFS serves the waiting queue in arrival order; under KV pressure
	// the most recently admitted running sequence is preempted.
	PolicyFCFS Policy = "fcfs"
	// PolicyPriority orders the waiting queue by (priority, arrival), lowest
	// first; under KV pressure the running sequence with the worst
	// (priority, arrival) is preempted. It never preempts a running sequence
	// to admit a waiting one.
	PolicyPriority Policy = "priority"
)

// Defaults. The engine defaults describe a mid-size model on one H100-class
// GPU: vLLM's own defaults where they exist (256 sequences, 16-token blocks,
// 8192 batched tokens as for `vllm serve` on H100), and a cost model in the
// range measured for a 30B MoE model (about 10k prefill tokens/s, a 10 ms
// decode step growing by 0.1 ms per sequence in the batch).
const (
	DefaultAddr                   = "127.0.0.1:8000"
	DefaultModel                  = "Qwen/Qwen3-30B-A3B"
	DefaultMaxNumSeqs             = 256
	DefaultMaxModelLen            = 32768
	DefaultNumGPUBlocks           = 16384
	DefaultBlockSize              = 16
	DefaultMaxNumBatchedTokens    = 8192
	DefaultPrefillTokensPerSecond = 10000
	DefaultDecodeStepBase         = 10 * time.Millisecond
	DefaultDecodeStepPerSeq       = 100 * time.Microsecond
	DefaultTimeScale              = 1
	DefaultMeanOutputTokens       = 256
	DefaultEmbeddingDim           = 1024
	DefaultFaultRetryAfter        = time.Second
)

// EngineConfig is the simulated engine: vLLM's scheduler and KV-cache
// settings plus the cost model that turns a scheduled batch into simulated
// time. See the package documentation for the cost model.
type EngineConfig struct {
	// MaxNumSeqs caps the running set (vLLM --max-num-seqs).
	MaxNumSeqs int
	// MaxModelLen caps prompt plus output tokens (--max-model-len).
	MaxModelLen int
	// NumGPUBlocks is the number of KV-cache blocks, including vLLM's
	// reserved null block (--num-gpu-blocks-override).
	NumGPUBlocks int
	// BlockSize is the number of tokens per KV-cache block (--block-size).
	BlockSize int
	// SchedulingPolicy is fcfs or priority (--scheduling-policy).
	SchedulingPolicy Policy
	// EnablePrefixCaching turns on automatic prefix caching
	// (--enable-prefix-caching; on by default in vLLM v1).
	EnablePrefixCaching bool
	// MaxNumBatchedTokens is the per-step token budget shared by decodes and
	// prefill chunks (--max-num-batched-tokens).
	MaxNumBatchedTokens int
	// LongPrefillTokenThreshold caps the tokens one request may prefill in a
	// step; 0 disables the cap (--long-prefill-token-threshold).
	LongPrefillTokenThreshold int
	// MaxNumQueuedReqs rejects new requests with 503 once this many are
	// unfinished (waiting or running); 0 disables the limit
	// (--max-num-queued-reqs). vLLM's literal 0, which rejects everything, has
	// no equivalent.
	MaxNumQueuedReqs int
	// MaxNumQueuedTokens rejects new requests with 503 once the prompt tokens
	// of the requests still in prefill (no output token yet) reach this
	// number; 0 disables the limit (--max-num-queued-tokens).
	MaxNumQueuedTokens int
	// PrefillTokensPerSecond is the prefill throughput: every prompt token a
	// step computes (cache hits excluded) costs 1/PrefillTokensPerSecond.
	PrefillTokensPerSecond float64
	// DecodeStepBase is the fixed cost of every step.
	DecodeStepBase time.Duration
	// DecodeStepPerSeq is the extra cost of every sequence in a step's batch.
	DecodeStepPerSeq time.Duration
}

// Faults configures fault injection for every request. Per-request headers
// (see the package documentation) inject the same faults on one request.
type Faults struct {
	// Status, when non-zero, answers requests with this HTTP status (429,
	// 500, 503, ...) and a vLLM-shaped error body instead of serving them.
	Status int
	// Probability is the fraction of requests that get Status; 0 means all.
	Probability float64
	// RetryAfter is sent as Retry-After (whole seconds, rounded up) with 429
	// and 503 faults; 0 omits the header.
	RetryAfter time.Duration
	// Delay is added, in wall-clock time, before a request is handled.
	Delay time.Duration
	// CutAfterChunks, when positive, aborts every stream's connection after
	// that many SSE chunks, without the terminating [DONE].
	CutAfterChunks int
	// ResetProbability is the fraction of new connections that are reset
	// right after they are accepted.
	ResetProbability float64
	// Metrics breaks GET /metrics: MetricsHang (the answer never comes;
	// the request is held until the client leaves), MetricsGone (404), or
	// MetricsFrozen (the page as of the first scrape after the fault was
	// set, forever). "" serves it normally.
	Metrics string
}

// Metrics faults (Faults.Metrics).
const (
	MetricsHang   = "hang"
	MetricsGone   = "gone"
	MetricsFrozen = "frozen"
)

// Config configures a simulated vLLM server.
type Config struct {
	EngineConfig

	// Addr is the TCP address Run and Start listen on.
	Addr string
	// Model is the model name (vLLM --model).
	Model string
	// ServedModelNames are the names the API accepts; the first one is used
	// in responses. Empty means Model (vLLM --served-model-name).
	ServedModelNames []string
	// APIKey, when set, is required as a bearer token on /v1 routes.
	APIKey string
	// TimeScale is how many simulated seconds pass per wall-clock second: 10
	// runs the engine ten times faster than real time. Every duration the
	// simulator reports (metrics included) is simulated time.
	TimeScale float64
	// Seed makes generated text, output lengths and fault draws
	// reproducible: the same requests in the same order give the same
	// answers.
	Seed uint64
	// MeanOutputTokens is the mean length of an answer the model stops by
	// itself (lengths are uniform in [mean/2, 3*mean/2]).
	MeanOutputTokens int
	// IgnoreEOS makes every request generate exactly its max_tokens, as the
	// ignore_eos request field does for one request.
	IgnoreEOS bool
	// EmbeddingDim is the length of the vectors /v1/embeddings returns.
	EmbeddingDim int
	// Faults is the fault injection applied to every request.
	Faults Faults
}

// DefaultEngineConfig returns the engine defaults.
func DefaultEngineConfig() EngineConfig {
	return EngineConfig{
		MaxNumSeqs:             DefaultMaxNumSeqs,
		MaxModelLen:            DefaultMaxModelLen,
		NumGPUBlocks:           DefaultNumGPUBlocks,
		BlockSize:              DefaultBlockSize,
		SchedulingPolicy:       PolicyFCFS,
		EnablePrefixCaching:    true,
		MaxNumBatchedTokens:    DefaultMaxNumBatchedTokens,
		PrefillTokensPerSecond: DefaultPrefillTokensPerSecond,
		DecodeStepBase:         DefaultDecodeStepBase,
		DecodeStepPerSeq:       DefaultDecodeStepPerSeq,
	}
}

// DefaultConfig returns a Config with every default applied.
func DefaultConfig() Config {
	return Config{
		EngineConfig:     DefaultEngineConfig(),
		Addr:             DefaultAddr,
		Model:            DefaultModel,
		TimeScale:        DefaultTimeScale,
		MeanOutputTokens: DefaultMeanOutputTokens,
		EmbeddingDim:     DefaultEmbeddingDim,
		Faults:           Faults{RetryAfter: DefaultFaultRetryAfter},
	}
}

// Validate reports every problem with the engine configuration at once.
func (c EngineConfig) Validate() error {
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.MaxNumSeqs < 1 {
		add("max-num-seqs must be at least 1, got %d", c.MaxNumSeqs)
	}
	if c.MaxModelLen < 2 {
		add("max-model-len must be at least 2, got %d", c.MaxModelLen)
	}
	if c.BlockSize < 1 {
		add("block-size must be at least 1, got %d", c.BlockSize)
	}
	if c.NumGPUBlocks < 2 {
		add("num-gpu-blocks must be at least 2 (one is vLLM's null block), got %d", c.NumGPUBlocks)
	}
	if c.BlockSize >= 1 && c.NumGPUBlocks >= 2 && c.MaxModelLen > (c.NumGPUBlocks-1)*c.BlockSize {
		add("max-model-len %d is larger than the KV cache holds ((%d-1) blocks of %d tokens = %d tokens)",
			c.MaxModelLen, c.NumGPUBlocks, c.BlockSize, (c.NumGPUBlocks-1)*c.BlockSize)
	}
	if c.SchedulingPolicy != PolicyFCFS && c.SchedulingPolicy != PolicyPriority {
		add("scheduling-policy must be %q or %q, got %q", PolicyFCFS, PolicyPriority, c.SchedulingPolicy)
	}
	if c.MaxNumBatchedTokens < 1 {
		add("max-num-batched-tokens must be at least 1, got %d", c.MaxNumBatchedTokens)
	} else if c.MaxNumBatchedTokens < c.MaxNumSeqs {
		add("max-num-batched-tokens (%d) must be at least max-num-seqs (%d)", c.MaxNumBatchedTokens, c.MaxNumSeqs)
	}
	if c.LongPrefillTokenThreshold < 0 {
		add("long-prefill-token-threshold must not be negative, got %d", c.LongPrefillTokenThreshold)
	}
	if c.MaxNumQueuedReqs < 0 {
		add("max-num-queued-reqs must not be negative, got %d", c.MaxNumQueuedReqs)
	}
	if c.MaxNumQueuedTokens < 0 {
		add("max-num-queued-tokens must not be negative, got %d", c.MaxNumQueuedTokens)
	}
	if !(c.PrefillTokensPerSecond > 0) {
		add("prefill-tokens-per-second must be positive, got %v", c.PrefillTokensPerSecond)
	}
	if c.DecodeStepBase <= 0 {
		add("decode-step-base must be positive (every step must take time), got %v", c.DecodeStepBase)
	}
	if c.DecodeStepPerSeq < 0 {
		add("decode-step-per-seq must not be negative, got %v", c.DecodeStepPerSeq)
	}
	return errors.Join(errs...)
}

// Validate reports every problem with the configuration at once.
func (c Config) Validate() error {
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if err := c.EngineConfig.Validate(); err != nil {
		errs = append(errs, err)
	}
	if _, _, err := net.SplitHostPort(c.Addr); err != nil {
		add("addr %q: %w", c.Addr, err)
	}
	if c.Model == "" {
		add("model must not be empty")
	}
	for i, n := range c.ServedModelNames {
		if n == "" {
			add("served-model-name %d is empty", i)
		}
	}
	if !(c.TimeScale > 0) {
		add("time-scale must be positive, got %v", c.TimeScale)
	}
	if c.MeanOutputTokens < 1 {
		add("mean-output-tokens must be at least 1, got %d", c.MeanOutputTokens)
	}
	if c.EmbeddingDim < 1 {
		add("embedding-dim must be at least 1, got %d", c.EmbeddingDim)
	}
	if err := c.Faults.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Validate reports every problem with the fault configuration at once.
func (f Faults) Validate() error {
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if f.Status != 0 && (f.Status < 400 || f.Status > 599) {
		add("fault-status must be 0 or an HTTP error status (400-599), got %d", f.Status)
	}
	if f.Probability < 0 || f.Probability > 1 {
		add("fault-probability must be in [0, 1], got %v", f.Probability)
	}
	if f.RetryAfter < 0 {
		add("fault-retry-after must not be negative, got %v", f.RetryAfter)
	}
	if f.Delay < 0 {
		add("fault-delay must not be negative, got %v", f.Delay)
	}
	if f.CutAfterChunks < 0 {
		add("fault-cut-after must not be negative, got %d", f.CutAfterChunks)
	}
	switch f.Metrics {
	case "", MetricsHang, MetricsGone, MetricsFrozen:
	default:
		add("metrics fault must be empty, %q, %q or %q, got %q", MetricsHang, MetricsGone, MetricsFrozen, f.Metrics)
	}
	if f.ResetProbability < 0 || f.ResetProbability > 1 {
		add("fault-reset-probability must be in [0, 1], got %v", f.ResetProbability)
	}
	return errors.Join(errs...)
}

// servedNames returns the names the API accepts; the first is canonical.
func (c Config) servedNames() []string {
	if len(c.ServedModelNames) > 0 {
		return c.ServedModelNames
	}
	return []string{c.Model}
}
