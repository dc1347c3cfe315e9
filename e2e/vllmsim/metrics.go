package vllmsim

import (
	"bufio"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
)

// Bucket bounds of vLLM's histograms, in seconds.
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
		2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	requestLatencyBuckets = []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
		40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
)

// Histogram is a Prometheus histogram of seconds.
type Histogram struct {
	// Bounds are the buckets' upper bounds, ascending; +Inf is implicit.
	Bounds []float64
	// Counts[i] is the number of observations v with Bounds[i-1] < v <=
	// Bounds[i] (not cumulative); Counts[len(Bounds)] counts the rest.
	Counts []uint64
	// Count is the number of observations.
	Count uint64
	// Sum is the total of the observations.
	Sum float64
}

func newHistogram(bounds []float64) Histogram {
	return Histogram{Bounds: bounds, Counts: make([]uint64, len(bounds)+1)}
}

func (h *Histogram) observe(v float64) {
	i, _ := slices.BinarySearch(h.Bounds, v)
	h.Counts[i]++
	h.Count++
	h.Sum += v
}

func (h Histogram) clone() Histogram {
	h.Counts = slices.Clone(h.Counts)
	return h
}

// writeMetrics renders st in the Prometheus text exposition format (0.0.4)
// with vLLM's metric names and labels.
func writeMetrics(w io.Writer, model string, st Stats) error {
	bw := bufio.NewWriter(w)
	labels := `engine="0",model_name="` + escapeLabel(model) + `"`
	gauge := func(name, help string, v float64) {
		header(bw, name, help, "gauge")
		sample(bw, name, labels, v)
	}
	counter := func(name, help string, v uint64) {
		header(bw, name, help, "counter")
		sample(bw, name, labels, float64(v))
	}
	gauge("vllm:num_requests_running", "Number of requests in model execution batches.", float64(st.NumRunning))
	gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", float64(st.NumWaiting))
	gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", st.KVCacheUsage)
	counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", st.NumPreemptions)
	counter("vllm:prefix_cache_queries_total",
		"Prefix cache queries, in terms of number of queried tokens.", st.PrefixCacheQueries)
	counter("vllm:prefix_cache_hits_total",
		"Prefix cache hits, in terms of number of cached tokens.", st.PrefixCacheHits)
	counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", st.PromptTokens)
	counter("vllm:generation_tokens_total", "Number of generation tokens processed.", st.GenerationTokens)

	header(bw, "vllm:request_success_total", "Count of successfully processed requests.", "counter")
	for _, r := range []struct {
		reason string
		n      uint64
	}{{"abort", st.FinishedAbort}, {"length", st.FinishedLength}, {"stop", st.FinishedStop}} {
		sample(bw, "vllm:request_success_total", labels+`,finished_reason="`+r.reason+`"`, float64(r.n))
	}

	histogram(bw, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
		labels, st.TimeToFirstToken)
	histogram(bw, "vllm:request_queue_time_seconds",
		"Histogram of time spent in WAITING phase for request.", labels, st.QueueTime)
	histogram(bw, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
		labels, st.E2ELatency)
	return bw.Flush()
}

// header and sample leave write errors to bw.Flush: a bufio.Writer's
// first error sticks and every later write is a no-op.
func header(w *bufio.Writer, name, help, typ string) {
	_, _ = w.WriteString("# HELP " + name + " " + help + "\n# TYPE " + name + " " + typ + "\n")
}

func sample(w *bufio.Writer, name, labels string, v float64) {
	_, _ = w.WriteString(name + "{" + labels + "} " + formatFloat(v) + "\n")
}

func histogram(w *bufio.Writer, name, help, labels string, h Histogram) {
	header(w, name, help, "histogram")
	var cum uint64
	for i, b := range h.Bounds {
		cum += h.Counts[i]
		sample(w, name+"_bucket", labels+`,le="`+formatFloat(b)+`"`, float64(cum))
	}
	sample(w, name+"_bucket", labels+`,le="+Inf"`, float64(h.Count))
	sample(w, name+"_sum", labels, h.Sum)
	sample(w, name+"_count", labels, float64(h.Count))
}

// formatFloat formats like Python's repr of a float, which is what vLLM's
// exposition shows: integers keep a ".0".
func formatFloat(v float64) string {
	switch {
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	case math.IsNaN(v):
		return "NaN"
	}
	s := strconv.FormatFloat(v, 'g', -1, 64)
	if !strings.ContainsAny(s, ".eEn") {
		s += ".0"
	}
	return s
}

var labelEscaper = strings.NewReplacer(`\`, `\\`, "\n", `\n`, `"`, `\"`)

func escapeLabel(s string) string { return labelEscaper.Replace(s) }
