package vllmsim

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func TestHTTPChatCompletion(t *testing.T) {
	s := startSim(t, nil)
	var resp chatResponse
	s.do("/v1/chat/completions", chatBody("Hello there, how are you?", map[string]any{
		"max_tokens": 20, "ignore_eos": true,
	}), http.StatusOK, &resp)
	if !strings.HasPrefix(resp.ID, "chatcmpl-") || resp.Object != "chat.completion" || resp.Model != DefaultModel || resp.Created == 0 {
		t.Errorf("envelope: id %q object %q model %q created %d", resp.ID, resp.Object, resp.Model, resp.Created)
	}
	if len(resp.Choices) != 1 {
		t.Fatalf("%d choices", len(resp.Choices))
	}
	c := resp.Choices[0]
	if c.Message.Role != "assistant" || c.FinishReason != "length" || c.Message.Content == "" {
		t.Errorf("choice: %+v", c)
	}
	if got := CountTokens(c.Message.Content); got != 20 {
		t.Errorf("content %q is %d tokens, want 20", c.Message.Content, got)
	}
	prompt, _ := renderChat([]chatMessage{{Role: "user", Content: jsonString("Hello there, how are you?")}}, nil)
	u := resp.Usage
	if u.PromptTokens != CountTokens(prompt) || u.CompletionTokens != 20 || u.TotalTokens != u.PromptTokens+20 {
		t.Errorf("usage %+v, want prompt %d completion 20", u, CountTokens(prompt))
	}
	if u.PromptTokensDetails != nil {
		t.Errorf("a cold prompt reported cached tokens: %+v", u.PromptTokensDetails)
	}
}

func TestHTTPChatStreamWithUsage(t *testing.T) {
	s := startSim(t, nil)
	body := chatBody("Tell me a story.", map[string]any{
		"max_tokens": 15, "ignore_eos": true, "seed": 5, "stream": true,
		"stream_options": map[string]any{"include_usage": true},
	})
	resp, err := s.post(context.Background(), "/v1/chat/completions", body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("status %d, content type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	events, err := sseEvents(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if events[len(events)-1] != "[DONE]" {
		t.Fatalf("last event %q, want [DONE]", events[len(events)-1])
	}
	var chunks []chunk
	for _, e := range events[:len(events)-1] {
		var c chunk
		if err := json.Unmarshal([]byte(e), &c); err != nil {
			t.Fatalf("chunk %q: %v", e, err)
		}
		if c.Object != "chat.completion.chunk" || !strings.HasPrefix(c.ID, "chatcmpl-") || c.Model != DefaultModel {
			t.Errorf("chunk envelope %+v", c)
		}
		chunks = append(chunks, c)
	}
	// role chunk, 15 content chunks, usage chunk
	if len(chunks) != 17 {
		t.Fatalf("%d chunks, want 17", len(chunks))
	}
	first := chunks[0].Choices[0]
	if first.Delta == nil || first.Delta.Role == nil || *first.Delta.Role != "assistant" {
		t.Errorf("first chunk is not the role chunk: %+v", chunks[0])
	}
	var text strings.Builder
	for i, c := range chunks[1:16] {
		ch := c.Choices[0]
		text.WriteString(*ch.Delta.Content)
		if (ch.FinishReason != nil) != (i == 14) {
			t.Errorf("content chunk %d finish_reason %v", i, ch.FinishReason)
		}
	}
	if fr := chunks[15].Choices[0].FinishReason; fr == nil || *fr != "length" {
		t.Errorf("final finish_reason %v, want length", fr)
	}
	last := chunks[16]
	if len(last.Choices) != 0 || last.Usage == nil || last.Usage.CompletionTokens != 15 ||
		last.Usage.TotalTokens != last.Usage.PromptTokens+15 {
		t.Errorf("usage chunk %+v", last)
	}
	// The same request without streaming gives the same text.
	delete(body, "stream")
	delete(body, "stream_options")
	var full chatResponse
	s.do("/v1/chat/completions", body, http.StatusOK, &full)
	if full.Choices[0].Message.Content != text.String() {
		t.Errorf("streamed %q, non-streamed %q", text.String(), full.Choices[0].Message.Content)
	}
}

// Without include_usage there is no usage chunk; X-Sim-Output-Tokens makes
// the model stop by itself after exactly that many tokens.
func TestHTTPStreamStopsAtOutputTokensHeader(t *testing.T) {
	s := startSim(t, nil)
	resp, err := s.post(context.Background(), "/v1/chat/completions",
		chatBody("hi", map[string]any{"stream": true}), HeaderOutputTokens+": 5")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	events, err := sseEvents(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	// role + 4 words + the end-of-sequence chunk (empty delta) + [DONE]
	if len(events) != 7 {
		t.Fatalf("%d events: %v", len(events), events)
	}
	var last chunk
	if err := json.Unmarshal([]byte(events[5]), &last); err != nil {
		t.Fatal(err)
	}
	ch := last.Choices[0]
	if ch.FinishReason == nil || *ch.FinishReason != "stop" || ch.Delta == nil || ch.Delta.Content != nil {
		t.Errorf("last chunk %s, want an empty delta with finish_reason stop", events[5])
	}
	for _, e := range events[:6] {
		if strings.Contains(e, `"usage"`) {
			t.Errorf("usage without include_usage: %s", e)
		}
	}

	var full chatResponse
	s.do("/v1/chat/completions", chatBody("hi", nil), http.StatusOK, &full, HeaderOutputTokens+": 5")
	if full.Usage.CompletionTokens != 5 || full.Choices[0].FinishReason != "stop" {
		t.Errorf("non-streaming: %d tokens, %q", full.Usage.CompletionTokens, full.Choices[0].FinishReason)
	}
}

func TestHTTPCompletions(t *testing.T) {
	s := startSim(t, nil)
	var resp chatResponse
	s.do("/v1/completions", map[string]any{"model": DefaultModel, "prompt": "Once upon a time", "ignore_eos": true},
		http.StatusOK, &resp)
	if resp.Object != "text_completion" || !strings.HasPrefix(resp.ID, "cmpl-") {
		t.Errorf("envelope %+v", resp)
	}
	if resp.Usage.CompletionTokens != completionsDefaultMaxTokens || resp.Usage.PromptTokens != CountTokens("Once upon a time") {
		t.Errorf("usage %+v", resp.Usage)
	}
	if CountTokens(resp.Choices[0].Text) != completionsDefaultMaxTokens {
		t.Errorf("text %q", resp.Choices[0].Text)
	}

	// Token IDs, two prompts and n=2: four choices; prompt tokens count once
	// per prompt.
	s.do("/v1/completions", map[string]any{"prompt": [][]int{{1, 2, 3}, {4, 5, 6, 7}}, "n": 2, "max_tokens": 3},
		http.StatusOK, &resp)
	if len(resp.Choices) != 4 || resp.Usage.PromptTokens != 7 || resp.Usage.CompletionTokens > 12 {
		t.Errorf("%d choices, usage %+v", len(resp.Choices), resp.Usage)
	}
	for i, c := range resp.Choices {
		if c.Index != i {
			t.Errorf("choice %d has index %d", i, c.Index)
		}
	}

	// Streaming completions have no role chunk.
	r, err := s.post(context.Background(), "/v1/completions",
		map[string]any{"prompt": "abc", "max_tokens": 4, "ignore_eos": true, "stream": true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	events, err := sseEvents(r.Body)
	if err != nil {
		t.Fatal(err)
	}
	if len(events) != 5 || events[4] != "[DONE]" {
		t.Fatalf("events %v", events)
	}
	var c chunk
	if err := json.Unmarshal([]byte(events[0]), &c); err != nil || c.Object != "text_completion" || c.Choices[0].Text == nil {
		t.Errorf("chunk %s (%v)", events[0], err)
	}

	var e errorResponse
	s.do("/v1/completions", map[string]any{"prompt": []int{1, VocabSize}}, http.StatusBadRequest, &e)
	if !strings.Contains(e.Error.Message, "out of vocabulary") {
		t.Errorf("error %+v", e)
	}
}

func TestHTTPEmbeddings(t *testing.T) {
	s := startSim(t, func(c *Config) { c.EmbeddingDim = 64 })
	type embResp struct {
		Object string `json:"object"`
		Data   []struct {
			Object    string          `json:"object"`
			Index     int             `json:"index"`
			Embedding json.RawMessage `json:"embedding"`
		} `json:"data"`
		Usage usageJSON `json:"usage"`
	}
	var f, b embResp
	s.do("/v1/embeddings", map[string]any{"input": []string{"alpha beta", "gamma"}}, http.StatusOK, &f)
	s.do("/v1/embeddings", map[string]any{"input": []string{"alpha beta", "gamma"}, "encoding_format": "base64"},
		http.StatusOK, &b)
	if f.Object != "list" || len(f.Data) != 2 || f.Usage.PromptTokens != CountTokens("alpha beta")+CountTokens("gamma") {
		t.Fatalf("response %+v", f)
	}
	var v0, v1 []float32
	if err := json.Unmarshal(f.Data[0].Embedding, &v0); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(f.Data[1].Embedding, &v1); err != nil {
		t.Fatal(err)
	}
	if len(v0) != 64 || slices.Equal(v0, v1) {
		t.Errorf("vectors: len %d, equal %v", len(v0), slices.Equal(v0, v1))
	}
	var norm float64
	for _, x := range v0 {
		norm += float64(x) * float64(x)
	}
	if math.Abs(norm-1) > 1e-5 {
		t.Errorf("|v| = %v, want 1", math.Sqrt(norm))
	}
	var enc string
	if err := json.Unmarshal(b.Data[0].Embedding, &enc); err != nil {
		t.Fatal(err)
	}
	raw, err := base64.StdEncoding.DecodeString(enc)
	if err != nil || len(raw) != 4*64 {
		t.Fatalf("base64: %d bytes, %v", len(raw), err)
	}
	for i := range v0 {
		if got := math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:])); got != v0[i] {
			t.Fatalf("base64 value %d = %v, float %v", i, got, v0[i])
		}
	}
	var d embResp
	s.do("/v1/embeddings", map[string]any{"input": "alpha beta", "dimensions": 8}, http.StatusOK, &d)
	var v8 []float32
	if err := json.Unmarshal(d.Data[0].Embedding, &v8); err != nil || len(v8) != 8 {
		t.Errorf("dimensions 8: %v (%v)", v8, err)
	}
	s.do("/v1/embeddings", map[string]any{"input": "x", "dimensions": 65}, http.StatusBadRequest, nil)
	if st := s.Stats(); st.FinishedStop != 5 {
		t.Errorf("embedding inputs through the engine: %d finished, want 5", st.FinishedStop)
	}
}

func TestHTTPModelsHealthVersionMetrics(t *testing.T) {
	s := startSim(t, func(c *Config) { c.ServedModelNames = []string{"qwen-30b", "qwen"} })
	code, body := s.get("/v1/models")
	var models struct {
		Object string `json:"object"`
		Data   []struct {
			ID          string `json:"id"`
			Object      string `json:"object"`
			OwnedBy     string `json:"owned_by"`
			Root        string `json:"root"`
			MaxModelLen int    `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.Unmarshal([]byte(body), &models); err != nil || code != 200 {
		t.Fatalf("models %d %s: %v", code, body, err)
	}
	if len(models.Data) != 2 || models.Data[0].ID != "qwen-30b" || models.Data[0].Root != DefaultModel ||
		models.Data[0].MaxModelLen != DefaultMaxModelLen || models.Data[0].OwnedBy != "vllm" {
		t.Errorf("models %+v", models)
	}
	var resp chatResponse
	s.do("/v1/chat/completions", map[string]any{"model": "qwen", "messages": []map[string]string{{"role": "user", "content": "x"}},
		"max_tokens": 2}, http.StatusOK, &resp)
	if resp.Model != "qwen-30b" {
		t.Errorf("model in answer %q, want the first served name", resp.Model)
	}
	var e errorResponse
	s.do("/v1/chat/completions", chatBody("x", nil), http.StatusNotFound, &e) // DefaultModel is not served
	if e.Error.Type != "NotFoundError" || e.Error.Code != 404 || !strings.Contains(e.Error.Message, "does not exist") {
		t.Errorf("unknown model error %+v", e)
	}
	if code, _ := s.get("/health"); code != 200 {
		t.Errorf("health %d", code)
	}
	if code, body := s.get("/version"); code != 200 || !strings.Contains(body, vllmVersion) {
		t.Errorf("version %d %s", code, body)
	}
	code, body = s.get("/metrics")
	if code != 200 {
		t.Fatalf("metrics %d", code)
	}
	m := parseExposition(t, body, "qwen-30b")
	wantMetric(t, m, "vllm:generation_tokens_total", 2)
	wantMetric(t, m, "vllm:num_requests_running", 0)
	for _, name := range []string{"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
		"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_queue_time_seconds_count",
		"vllm:time_to_first_token_seconds_count"} {
		if _, ok := m[name]; !ok {
			t.Errorf("metric %s missing", name)
		}
	}
	if code, body := s.get("/nope"); code != 404 || !strings.Contains(body, "Not Found") {
		t.Errorf("unknown route %d %s", code, body)
	}
}

func TestHTTPAPIKey(t *testing.T) {
	s := startSim(t, func(c *Config) { c.APIKey = "sk-sim" })
	var e map[string]any
	s.do("/v1/chat/completions", chatBody("x", nil), http.StatusUnauthorized, &e)
	if e["error"] != "Unauthorized" {
		t.Errorf("401 body %v", e)
	}
	s.do("/v1/chat/completions", chatBody("x", nil), http.StatusUnauthorized, nil, "Authorization: Bearer sk-other")
	s.do("/v1/chat/completions", chatBody("x", map[string]any{"max_tokens": 1}), http.StatusOK, nil, "Authorization: Bearer sk-sim")
	if code, _ := s.get("/health"); code != 200 {
		t.Errorf("health needs no key, got %d", code)
	}
	if code, _ := s.get("/metrics"); code != 200 {
		t.Errorf("metrics need no key, got %d", code)
	}
}

func TestHTTPPriority(t *testing.T) {
	fcfs := startSim(t, nil)
	var e errorResponse
	fcfs.do("/v1/chat/completions", chatBody("x", map[string]any{"priority": 5}), http.StatusBadRequest, &e)
	if e.Error.Message != "Got priority 5 but Priority scheduling is not enabled." || e.Error.Type != "BadRequestError" || e.Error.Code != 400 {
		t.Errorf("fcfs with priority: %+v", e)
	}
	// The header wins over the body.
	fcfs.do("/v1/chat/completions", chatBody("x", map[string]any{"priority": 5, "max_tokens": 1}), http.StatusOK, nil,
		"X-Vllm-Priority: 0")
	fcfs.do("/v1/chat/completions", chatBody("x", nil), http.StatusBadRequest, &e, "X-Vllm-Priority: 3")
	fcfs.do("/v1/chat/completions", chatBody("x", nil), http.StatusBadRequest, &e, "X-Vllm-Priority: high")
	if !strings.Contains(e.Error.Message, "X-Vllm-Priority") {
		t.Errorf("bad header: %+v", e)
	}
	prio := startSim(t, func(c *Config) { c.SchedulingPolicy = PolicyPriority })
	prio.do("/v1/chat/completions", chatBody("x", map[string]any{"priority": 5, "max_tokens": 1}), http.StatusOK, nil,
		"X-Vllm-Priority: -3")
}

// The header's priority reaches the scheduler: on a one-slot engine, of two
// queued requests the one whose header says -1 runs first, although its
// body says 9 and it arrived second.
func TestHTTPPriorityHeaderOrdersTheQueue(t *testing.T) {
	s := startSim(t, func(c *Config) {
		c.SchedulingPolicy = PolicyPriority
		c.MaxNumSeqs = 1
		c.MaxNumBatchedTokens = 8192
		c.TimeScale = 20
	})
	type result struct {
		name string
		err  error
	}
	results := make(chan result, 3)
	send := func(name string, body map[string]any, headers ...string) {
		go func() {
			resp, err := s.post(context.Background(), "/v1/chat/completions", body, headers...)
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					err = errors.New(resp.Status)
				}
			}
			results <- result{name, err}
		}()
	}
	// Each request holds the only slot for 50 to 100 decode steps (0.5 to
	// 1 s simulated, 25 to 50 ms of wall time): completions are far apart.
	send("blocker", chatBody("block", map[string]any{"max_tokens": 100, "ignore_eos": true}))
	waitFor(t, func() bool { return s.Stats().NumRunning == 1 })
	send("low", chatBody("low", map[string]any{"max_tokens": 50, "ignore_eos": true, "priority": 0}))
	waitFor(t, func() bool { return s.Stats().NumWaiting == 1 })
	send("high", chatBody("high", map[string]any{"max_tokens": 50, "ignore_eos": true, "priority": 9}),
		"X-Vllm-Priority: -1")
	waitFor(t, func() bool { return s.Stats().NumWaiting == 2 })
	var order []string
	for range 3 {
		r := <-results
		if r.err != nil {
			t.Errorf("%s: %v", r.name, r.err)
		}
		order = append(order, r.name)
	}
	if !slices.Equal(order, []string{"blocker", "high", "low"}) {
		t.Errorf("completion order %v, want blocker, high, low", order)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 10 s")
		}
		time.Sleep(time.Millisecond)
	}
}

func TestHTTPValidationErrors(t *testing.T) {
	s := startSim(t, func(c *Config) { c.MaxModelLen = 1000; c.NumGPUBlocks = 100 })
	long := FillerText(3, 1200)
	var e errorResponse
	s.do("/v1/completions", map[string]any{"prompt": long}, http.StatusBadRequest, &e)
	if !strings.Contains(e.Error.Message, "maximum context length is 1000 tokens. However, your request has 1200 input tokens") {
		t.Errorf("long prompt: %+v", e)
	}
	s.do("/v1/completions", map[string]any{"prompt": FillerText(3, 900), "max_tokens": 200}, http.StatusBadRequest, &e)
	if !strings.Contains(e.Error.Message, "you requested 200 output tokens and your prompt contains at least 900 input tokens, for a total of at least 1100 tokens") ||
		e.Error.Param == nil || *e.Error.Param != "max_tokens" {
		t.Errorf("max_tokens too large: %+v", e)
	}
	for _, body := range []map[string]any{
		{"messages": []any{}},
		{"messages": "nope"},
		{"messages": []map[string]any{{"role": "user", "content": []map[string]any{{"type": "image_url"}}}}},
		chatBody("x", map[string]any{"max_tokens": 0}),
		chatBody("x", map[string]any{"n": 0}),
		chatBody("x", map[string]any{"stream_options": map[string]any{"include_usage": true}}),
		chatBody("x", map[string]any{"min_tokens": 5, "max_tokens": 2}),
	} {
		s.do("/v1/chat/completions", body, http.StatusBadRequest, &e)
		if e.Error.Type != "BadRequestError" || e.Error.Code != 400 || e.Error.Message == "" {
			t.Errorf("%v: %+v", body, e)
		}
	}
	// Content parts are joined.
	var resp chatResponse
	s.do("/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": []map[string]any{
		{"type": "text", "text": "a"}, {"type": "text", "text": "b"}}}}, "max_tokens": 1}, http.StatusOK, &resp)
	want, _ := renderChat([]chatMessage{{Role: "user", Content: jsonString("a\nb")}}, nil)
	if resp.Usage.PromptTokens != CountTokens(want) {
		t.Errorf("content parts: %d prompt tokens, want %d", resp.Usage.PromptTokens, CountTokens(want))
	}
}

// max-num-queued-reqs answers 503 with vLLM 0.29's message once that many
// requests are unfinished; the limit frees up when they finish or go away.
func TestHTTPMaxNumQueuedReqs(t *testing.T) {
	s := startSim(t, func(c *Config) {
		c.MaxNumQueuedReqs = 1
		c.TimeScale = 1
		// A 100-token prompt is prefilled 4 tokens per 50 ms step.
		c.MaxNumSeqs = 4
		c.MaxNumBatchedTokens = 4
		c.PrefillTokensPerSecond = 100
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		resp, err := s.post(ctx, "/v1/completions", map[string]any{"prompt": FillerText(1, 100), "max_tokens": 1})
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	waitFor(t, func() bool { return s.Stats().NumUnfinished == 1 })
	var e errorResponse
	s.do("/v1/completions", map[string]any{"prompt": "x", "max_tokens": 1}, http.StatusServiceUnavailable, &e)
	if e.Error.Message != "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance." ||
		e.Error.Type != "Service Unavailable" || e.Error.Code != 503 {
		t.Errorf("503 body %+v", e)
	}
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled request: %v", err)
	}
	waitFor(t, func() bool { return s.Stats().NumUnfinished == 0 })
	s.do("/v1/completions", map[string]any{"prompt": "x", "max_tokens": 1}, http.StatusOK, nil)
	if st := s.Stats(); st.FinishedAbort != 1 {
		t.Errorf("aborted = %d, want 1", st.FinishedAbort)
	}
}

func TestHTTPMaxNumQueuedTokens(t *testing.T) {
	s := startSim(t, func(c *Config) {
		c.MaxNumQueuedTokens = 50
		c.TimeScale = 1
		c.PrefillTokensPerSecond = 10
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := s.post(ctx, "/v1/completions", map[string]any{"prompt": FillerText(1, 60), "max_tokens": 1})
		if err == nil {
			resp.Body.Close()
		}
	}()
	waitFor(t, func() bool { return s.Stats().QueuedPrefillTokens == 60 })
	var e errorResponse
	s.do("/v1/completions", map[string]any{"prompt": "x", "max_tokens": 1}, http.StatusServiceUnavailable, &e)
	if !strings.Contains(e.Error.Message, "prefill token backlog limit") {
		t.Errorf("503 body %+v", e)
	}
	cancel()
	<-done
}

func TestHTTPFaultStatus(t *testing.T) {
	s := startSim(t, nil)
	resp, err := s.post(context.Background(), "/v1/chat/completions", chatBody("x", nil),
		HeaderFaultStatus+": 429", HeaderFaultRetryAfter+": 1500ms")
	if err != nil {
		t.Fatal(err)
	}
	var e errorResponse
	if err := json.NewDecoder(resp.Body).Decode(&e); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 429 || resp.Header.Get("Retry-After") != "2" || e.Error.Code != 429 || e.Error.Message == "" {
		t.Errorf("429 fault: status %d retry-after %q body %+v", resp.StatusCode, resp.Header.Get("Retry-After"), e)
	}
	s.do("/v1/chat/completions", chatBody("x", nil), http.StatusInternalServerError, &e, HeaderFaultStatus+": 500")
	if e.Error.Type != "InternalServerError" {
		t.Errorf("500 fault type %q", e.Error.Type)
	}

	mustSetFaults(t, s, Faults{Status: 503, RetryAfter: 3 * time.Second})
	resp, err = s.post(context.Background(), "/v1/completions", map[string]any{"prompt": "x"})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "3" {
		t.Errorf("configured 503: status %d retry-after %q", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	if code, _ := s.get("/health"); code != 200 {
		t.Errorf("faults reached /health: %d", code)
	}
	// Half of the requests, drawn from the seeded generator.
	mustSetFaults(t, s, Faults{Status: 503, Probability: 0.5})
	failed := 0
	for range 40 {
		resp, err := s.post(context.Background(), "/v1/completions", map[string]any{"prompt": "x", "max_tokens": 1})
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode == 503 {
			failed++
		}
	}
	if failed < 8 || failed > 32 {
		t.Errorf("%d of 40 requests failed at probability 0.5", failed)
	}
	s.do("/v1/chat/completions", chatBody("x", nil), http.StatusBadRequest, nil, HeaderFaultStatus+": 200")
}

func TestHTTPFaultDelay(t *testing.T) {
	s := startSim(t, nil)
	start := time.Now()
	s.do("/v1/chat/completions", chatBody("x", map[string]any{"max_tokens": 1}), http.StatusOK, nil, HeaderFaultDelay+": 150")
	if d := time.Since(start); d < 150*time.Millisecond {
		t.Errorf("request took %v with a 150 ms delay", d)
	}
}

func TestHTTPFaultCutStream(t *testing.T) {
	s := startSim(t, nil)
	body := chatBody("x", map[string]any{"max_tokens": 50, "ignore_eos": true, "stream": true})
	resp, err := s.post(context.Background(), "/v1/chat/completions", body, HeaderFaultCutAfter+": 3")
	if err != nil {
		t.Fatal(err)
	}
	events, err := sseEvents(resp.Body)
	resp.Body.Close()
	if len(events) != 3 || err == nil {
		t.Errorf("cut after 3: got %d events and error %v; want 3 and a broken stream", len(events), err)
	}
	// Flag-level cut, and a cut non-streaming request never gets an answer.
	mustSetFaults(t, s, Faults{CutAfterChunks: 2})
	resp, err = s.post(context.Background(), "/v1/chat/completions", body)
	if err != nil {
		t.Fatal(err)
	}
	events, err = sseEvents(resp.Body)
	resp.Body.Close()
	if len(events) != 2 || err == nil {
		t.Errorf("configured cut after 2: %d events, error %v", len(events), err)
	}
	delete(body, "stream")
	if _, err := s.post(context.Background(), "/v1/chat/completions", body); err == nil {
		t.Error("a cut non-streaming request got an answer")
	}
	waitFor(t, func() bool { return s.Stats().NumUnfinished == 0 })
}

// postFresh posts on a new connection.
func postFresh(s *sim, body any, headers ...string) error {
	fresh := &sim{Server: s.Server, t: s.t, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}}
	resp, err := fresh.post(context.Background(), "/v1/chat/completions", body, headers...)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return errors.New(resp.Status)
	}
	return nil
}

func TestHTTPRefuseConnections(t *testing.T) {
	s := startSim(t, nil)
	ok := chatBody("x", map[string]any{"max_tokens": 1})
	s.do("/v1/chat/completions", ok, http.StatusOK, nil)
	if err := s.SetRefuseConnections(true); err != nil {
		t.Fatal(err)
	}
	// The pooled connection was dropped, as by a crashed engine...
	if _, err := s.post(context.Background(), "/v1/chat/completions", ok); err == nil {
		t.Error("a pooled connection survived")
	}
	// ... and new connections are refused.
	if err := postFresh(s, ok); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("while refusing: %v, want connection refused", err)
	}
	if err := s.SetRefuseConnections(false); err != nil {
		t.Fatal(err)
	}
	if err := postFresh(s, ok); err != nil {
		t.Errorf("after accepting again: %v", err)
	}

	// The header form: this request's connection drops, and the port refuses
	// connections for a while.
	if err := postFresh(s, ok, HeaderFaultRefuseFor+": 300ms"); err == nil {
		t.Error("the refusing request got an answer")
	}
	if err := postFresh(s, ok); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("right after the refuse-for fault: %v, want connection refused", err)
	}
	waitFor(t, func() bool { return postFresh(s, ok) == nil })
}

func TestHTTPResetConnections(t *testing.T) {
	s := startSim(t, func(c *Config) { c.Faults.ResetProbability = 1 })
	if _, err := s.post(context.Background(), "/v1/chat/completions", chatBody("x", nil)); err == nil {
		t.Error("request succeeded although every connection is reset")
	}
	mustSetFaults(t, s, Faults{})
	s.do("/v1/chat/completions", chatBody("x", map[string]any{"max_tokens": 1}), http.StatusOK, nil)
	if err := s.SetFaults(Faults{Status: 302}); err == nil {
		t.Error("SetFaults accepted status 302")
	}
}

func mustSetFaults(t *testing.T, s *sim, f Faults) {
	t.Helper()
	if err := s.SetFaults(f); err != nil {
		t.Fatal(err)
	}
}

// A client that goes away mid-stream aborts its request in the engine.
func TestHTTPClientDisconnectAbortsRequest(t *testing.T) {
	s := startSim(t, func(c *Config) { c.TimeScale = 10 })
	ctx, cancel := context.WithCancel(context.Background())
	resp, err := s.post(ctx, "/v1/chat/completions",
		chatBody("x", map[string]any{"max_tokens": 5000, "ignore_eos": true, "stream": true}))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 512)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.NumRunning != 1 {
		t.Errorf("running = %d during the stream", st.NumRunning)
	}
	cancel()
	resp.Body.Close()
	waitFor(t, func() bool { st := s.Stats(); return st.NumRunning == 0 && st.FinishedAbort == 1 })
	if st := s.Stats(); st.KVCacheUsage != 0 {
		t.Errorf("KV usage %v after the abort", st.KVCacheUsage)
	}
}

// The second turn of a conversation reports the first turn's blocks as
// cached tokens.
func TestHTTPSecondTurnReportsCachedTokens(t *testing.T) {
	s := startSim(t, nil)
	msgs := []map[string]any{
		{"role": "system", "content": FillerText(10, 500)},
		{"role": "user", "content": "What is a KV cache?"},
	}
	var r1 chatResponse
	s.do("/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": 64}, http.StatusOK, &r1,
		HeaderOutputTokens+": 30")
	if r1.Usage.cached() != 0 {
		t.Errorf("turn 1 cached %d", r1.Usage.cached())
	}
	msgs = append(msgs,
		map[string]any{"role": "assistant", "content": r1.Choices[0].Message.Content},
		map[string]any{"role": "user", "content": "And a prefix cache?"})
	var r2 chatResponse
	s.do("/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": 8}, http.StatusOK, &r2)
	// Turn 1 computed its prompt and all but its last (end-of-sequence)
	// token: its full 16-token blocks are cached.
	want := (r1.Usage.PromptTokens + r1.Usage.CompletionTokens - 1) / DefaultBlockSize * DefaultBlockSize
	if r2.Usage.cached() != want {
		t.Errorf("turn 2 cached tokens %d, want %d", r2.Usage.cached(), want)
	}
	m := parseExposition(t, mustMetrics(t, s), DefaultModel)
	wantMetric(t, m, "vllm:prefix_cache_hits_total", float64(want))
	wantMetric(t, m, "vllm:prefix_cache_queries_total", float64(r1.Usage.PromptTokens+r2.Usage.PromptTokens))
}

func mustMetrics(t *testing.T, s *sim) string {
	t.Helper()
	code, body := s.get("/metrics")
	if code != 200 {
		t.Fatalf("metrics: %d", code)
	}
	return body
}

// Seeded servers answer the same requests, in the same order, with the
// same text; a request seed makes the text independent of the order.
func TestHTTPDeterministicWhenSeeded(t *testing.T) {
	texts := func(s *sim, seeds ...any) []string {
		var out []string
		for _, seed := range seeds {
			body := chatBody("same prompt", map[string]any{"max_tokens": 12, "ignore_eos": true})
			if seed != nil {
				body["seed"] = seed
			}
			var r chatResponse
			s.do("/v1/chat/completions", body, http.StatusOK, &r)
			out = append(out, r.Choices[0].Message.Content)
		}
		return out
	}
	a := texts(startSim(t, func(c *Config) { c.Seed = 42 }), nil, nil, 7)
	b := texts(startSim(t, func(c *Config) { c.Seed = 42 }), nil, nil, 7)
	if !slices.Equal(a, b) {
		t.Errorf("same seed, different answers:\n%q\n%q", a, b)
	}
	if a[0] == a[1] {
		t.Errorf("two unseeded requests gave the same text %q", a[0])
	}
	c := texts(startSim(t, func(c *Config) { c.Seed = 42 }), 7)
	if c[0] != a[2] {
		t.Errorf("seeded request depends on its order: %q vs %q", c[0], a[2])
	}
	d := texts(startSim(t, func(c *Config) { c.Seed = 43 }), nil)
	if d[0] == a[0] {
		t.Errorf("different server seeds gave the same text")
	}
}

func TestHTTPRequestIDHeader(t *testing.T) {
	s := startSim(t, nil)
	var r chatResponse
	h := s.do("/v1/chat/completions", chatBody("x", map[string]any{"max_tokens": 1}), http.StatusOK, &r, "X-Request-Id: abc123")
	if r.ID != "chatcmpl-abc123" || h.Get("X-Request-Id") != "abc123" {
		t.Errorf("id %q, header %q", r.ID, h.Get("X-Request-Id"))
	}
}

func TestHTTPTokenize(t *testing.T) {
	s := startSim(t, nil)
	var out struct {
		Count       int `json:"count"`
		MaxModelLen int `json:"max_model_len"`
		Tokens      []TokenID
	}
	s.do("/tokenize", map[string]any{"prompt": "Hello, world"}, http.StatusOK, &out)
	if out.Count != CountTokens("Hello, world") || !slices.Equal(out.Tokens, Tokenize("Hello, world")) || out.MaxModelLen != DefaultMaxModelLen {
		t.Errorf("tokenize %+v", out)
	}
}

// Closing the server fails the streams in flight with an error event.
func TestServerCloseFailsStreamsInFlight(t *testing.T) {
	s, err := Start(simConfig(func(c *Config) { c.TimeScale = 1 }), testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Transport: &http.Transport{}}
	resp, err := client.Post(s.URL()+"/v1/chat/completions", "application/json", strings.NewReader(
		`{"messages":[{"role":"user","content":"x"}],"max_tokens":10000,"ignore_eos":true,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	waitFor(t, func() bool { return s.Stats().NumRunning == 1 })
	if err := s.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	if !strings.Contains(string(body), `"error"`) || !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
		t.Errorf("stream after Close ended with %q", tail(string(body), 200))
	}
	if s.URL() != "" {
		t.Errorf("URL after Close = %q", s.URL())
	}
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}

// Handler can be served by any http.Server while RunEngine drives the
// engine.
func TestHandlerWithRunEngine(t *testing.T) {
	srv, err := New(simConfig(nil), testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.RunEngine(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("RunEngine: %v", err)
		}
	}()
	rec := httptest.NewRecorder()
	req, _ := http.NewRequest(http.MethodPost, "/v1/chat/completions",
		strings.NewReader(`{"messages":[{"role":"user","content":"x"}],"max_tokens":3,"ignore_eos":true}`))
	srv.Handler().ServeHTTP(rec, req)
	var r chatResponse
	if err := json.Unmarshal(rec.Body.Bytes(), &r); err != nil || rec.Code != 200 || r.Usage.CompletionTokens != 3 {
		t.Errorf("status %d body %s (%v)", rec.Code, rec.Body.String(), err)
	}
}

func TestConfigValidateReportsEveryProblem(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Addr = "nope"
	cfg.Model = ""
	cfg.TimeScale = 0
	cfg.MaxNumSeqs = 0
	cfg.EmbeddingDim = 0
	cfg.Faults = Faults{Status: 200, Probability: 2, CutAfterChunks: -1, ResetProbability: -1}
	err := cfg.Validate()
	if err == nil {
		t.Fatal("Validate accepted a broken config")
	}
	for _, want := range []string{"addr", "model must not be empty", "time-scale", "max-num-seqs", "embedding-dim",
		"fault-status", "fault-probability", "fault-cut-after", "fault-reset-probability"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q:\n%v", want, err)
		}
	}
	if _, err := New(cfg, testLogger(t)); err == nil {
		t.Error("New accepted a broken config")
	}
	if err := DefaultConfig().Validate(); err != nil {
		t.Errorf("defaults: %v", err)
	}
}

// At debug level every request gets one access-log line, and streaming
// still flushes through the logging wrapper.
func TestHTTPAccessLogAtDebugLevel(t *testing.T) {
	var logs syncBuffer
	srv, err := Start(simConfig(nil), slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	if err != nil {
		t.Fatal(err)
	}
	s := &sim{Server: srv, t: t, client: &http.Client{Transport: &http.Transport{}}}
	resp, err := s.post(context.Background(), "/v1/chat/completions",
		chatBody("x", map[string]any{"max_tokens": 3, "ignore_eos": true, "stream": true}), "X-Request-Id: r-1")
	if err != nil {
		t.Fatal(err)
	}
	events, err := sseEvents(resp.Body)
	resp.Body.Close()
	if err != nil || len(events) != 5 {
		t.Errorf("stream through the access log: %d events, %v", len(events), err)
	}
	s.client.CloseIdleConnections()
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	out := logs.String()
	if !strings.Contains(out, "msg=request method=POST path=/v1/chat/completions status=200") ||
		!strings.Contains(out, "request_id=r-1") {
		t.Errorf("access log:\n%s", out)
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
