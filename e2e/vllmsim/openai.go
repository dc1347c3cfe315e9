package vllmsim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// maxBodyBytes bounds request bodies (a 128k-token prompt is about 512 KiB).
const maxBodyBytes = 64 << 20

// vllmVersion is the vLLM version the simulator imitates.
const vllmVersion = "0.29.0"

// apiError is an error answered in vLLM's error shape.
type apiError struct {
	status  int
	typ     string
	message string
	param   string
}

// Error returns the message.
func (e *apiError) Error() string { return e.message }

func badRequest(format string, args ...any) *apiError {
	return &apiError{status: http.StatusBadRequest, typ: "BadRequestError", message: fmt.Sprintf(format, args...)}
}

// errorBody renders vLLM's ErrorResponse: {"error": {message, type, param, code}}.
func errorBody(e *apiError) []byte {
	var param any
	if e.param != "" {
		param = e.param
	}
	b, _ := json.Marshal(map[string]any{"error": map[string]any{
		"message": e.message, "type": e.typ, "param": param, "code": e.status,
	}})
	return b
}

func writeAPIError(w http.ResponseWriter, e *apiError) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(e.status)
	_, _ = w.Write(errorBody(e))
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeAPIError(w, &apiError{status: 500, typ: "InternalServerError", message: err.Error()})
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// routes builds the HTTP API.
func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("GET /version", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"version": vllmVersion})
	})
	mux.HandleFunc("GET /metrics", s.handleMetrics)
	mux.HandleFunc("POST /tokenize", s.handleTokenize)
	mux.HandleFunc("GET /v1/models", s.handleModels)
	mux.HandleFunc("POST /v1/chat/completions", s.handleChat)
	mux.HandleFunc("POST /v1/completions", s.handleCompletions)
	mux.HandleFunc("POST /v1/embeddings", s.handleEmbeddings)
	s.protocolRoutes(mux)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusNotFound, map[string]string{"detail": "Not Found"})
	})
	return s.accessLog(s.middleware(mux))
}

// statusWriter records the status of a response for the access log.
type statusWriter struct {
	http.ResponseWriter
	status int
}

// WriteHeader records the status.
func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

// Write records an implicit 200.
func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the connection's Flush.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// accessLog logs one line per request at debug level; it costs nothing
// when debug logging is off.
func (s *Server) accessLog(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.log.Enabled(r.Context(), slog.LevelDebug) {
			next.ServeHTTP(w, r)
			return
		}
		start := time.Now()
		sw := &statusWriter{ResponseWriter: w}
		defer func() {
			s.log.Debug("request", slog.String("method", r.Method), slog.String("path", r.URL.Path),
				slog.Int("status", sw.status), slog.Int64("duration_ms", time.Since(start).Milliseconds()),
				slog.String("request_id", r.Header.Get("X-Request-Id")))
		}()
		next.ServeHTTP(sw, r)
	})
}

// middleware authenticates /v1 routes (as vLLM: 401 {"error":"Unauthorized"})
// and injects the configured and per-request faults there.
func (s *Server) middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasPrefix(r.URL.Path, "/v1") {
			next.ServeHTTP(w, r)
			return
		}
		if s.cfg.APIKey != "" && r.Method != http.MethodOptions && !bearerOK(r.Header.Get("Authorization"), s.cfg.APIKey) {
			writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "Unauthorized"})
			return
		}
		f, err := s.requestFaults(r)
		if err != nil {
			writeAPIError(w, badRequest("%v", err))
			return
		}
		if f.delay > 0 {
			t := time.NewTimer(f.delay)
			select {
			case <-r.Context().Done():
				t.Stop()
				return
			case <-t.C:
			}
		}
		if f.refuseFor > 0 {
			s.log.Debug("fault: refusing connections", slog.Duration("for", f.refuseFor))
			s.refuseFor(f.refuseFor)
			panic(http.ErrAbortHandler)
		}
		if f.status != 0 {
			s.log.Debug("fault: status", slog.Int("status", f.status), slog.String("path", r.URL.Path))
			if f.retryAfter > 0 && (f.status == http.StatusTooManyRequests || f.status == http.StatusServiceUnavailable) {
				secs := int64((f.retryAfter + time.Second - 1) / time.Second)
				w.Header().Set("Retry-After", strconv.FormatInt(secs, 10))
			}
			writeAPIError(w, &apiError{status: f.status, typ: faultType(f.status), message: faultMessage(f.status)})
			return
		}
		if f.cutAfter >= 0 {
			r = r.WithContext(withCutAfter(r.Context(), f.cutAfter))
		}
		next.ServeHTTP(w, r)
	})
}

func (s *Server) handleMetrics(w http.ResponseWriter, r *http.Request) {
	switch s.faults.Load().Metrics {
	case MetricsHang:
		<-r.Context().Done()
		return
	case MetricsGone:
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	if s.faults.Load().Metrics == MetricsFrozen {
		page := s.frozenMetrics.Load()
		if page == nil {
			b := s.metricsPage()
			s.frozenMetrics.CompareAndSwap(nil, &b)
			page = s.frozenMetrics.Load()
		}
		_, _ = w.Write(*page)
		return
	}
	_, _ = w.Write(s.metricsPage())
}

// metricsPage renders the /metrics page now.
func (s *Server) metricsPage() []byte {
	var b bytes.Buffer
	st, _ := s.eng.stats()
	if err := writeMetrics(&b, s.names[0], st); err != nil {
		s.log.Debug("write metrics", slog.Any("error", err))
	}
	if err := writePriorityMetrics(&b, s.names[0], s.prios.snapshot()); err != nil {
		s.log.Debug("write metrics", slog.Any("error", err))
	}
	return b.Bytes()
}

func (s *Server) handleModels(w http.ResponseWriter, r *http.Request) {
	type model struct {
		ID          string  `json:"id"`
		Object      string  `json:"object"`
		Created     int64   `json:"created"`
		OwnedBy     string  `json:"owned_by"`
		Root        string  `json:"root"`
		Parent      *string `json:"parent"`
		MaxModelLen int     `json:"max_model_len"`
		Permission  []any   `json:"permission"`
	}
	data := make([]model, 0, len(s.names))
	for _, n := range s.names {
		data = append(data, model{ID: n, Object: "model", Created: s.created, OwnedBy: "vllm", Root: s.cfg.Model,
			MaxModelLen: s.cfg.MaxModelLen, Permission: []any{}})
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}

func (s *Server) handleTokenize(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Prompt   *string         `json:"prompt"`
		Messages []chatMessage   `json:"messages"`
		Tools    json.RawMessage `json:"tools"`
	}
	if err := decodeBody(w, r, &req); err != nil {
		writeAPIError(w, err)
		return
	}
	var text string
	switch {
	case req.Prompt != nil:
		text = *req.Prompt
	case req.Messages != nil:
		t, err := renderChat(req.Messages, req.Tools)
		if err != nil {
			writeAPIError(w, err)
			return
		}
		text = t
	default:
		writeAPIError(w, badRequest("either prompt or messages is required"))
		return
	}
	toks := Tokenize(text)
	writeJSON(w, http.StatusOK, map[string]any{
		"count": len(toks), "max_model_len": s.cfg.MaxModelLen, "tokens": toks, "token_strs": nil,
	})
}

// decodeBody decodes a JSON body, answering vLLM-style on failure.
func decodeBody(w http.ResponseWriter, r *http.Request, v any) *apiError {
	body, err := readAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return &apiError{status: http.StatusRequestEntityTooLarge, typ: "BadRequestError",
				message: fmt.Sprintf("request body is larger than %d bytes", mbe.Limit)}
		}
		return badRequest("read request body: %v", err)
	}
	if err := json.Unmarshal(body, v); err != nil {
		return badRequest("invalid JSON body: %v", err)
	}
	return nil
}

func readAll(r interface{ Read([]byte) (int, error) }) ([]byte, error) {
	var buf bytes.Buffer
	_, err := buf.ReadFrom(r)
	return buf.Bytes(), err
}

// checkModel is vLLM's model check: an empty name is accepted.
func (s *Server) checkModel(name string) *apiError {
	if name == "" {
		return nil
	}
	for _, n := range s.names {
		if n == name {
			return nil
		}
	}
	return &apiError{status: http.StatusNotFound, typ: "NotFoundError", param: "model",
		message: fmt.Sprintf("The model `%s` does not exist.", name)}
}

// priorityOf returns the request's priority: the X-Vllm-Priority header wins
// over the body field. Under fcfs a non-zero priority is refused, as vLLM's
// input processor does.
func (s *Server) priorityOf(r *http.Request, body *int) (int, *apiError) {
	p, present := 0, body != nil
	if body != nil {
		p = *body
	}
	if h := r.Header.Get("X-Vllm-Priority"); h != "" {
		v, err := strconv.Atoi(strings.TrimSpace(h))
		if err != nil {
			return 0, badRequest("invalid X-Vllm-Priority header %q: must be an integer", h)
		}
		p, present = v, true
	}
	if p != 0 && s.cfg.SchedulingPolicy != PolicyPriority {
		s.prios.record(present, p, true)
		return 0, badRequest("Got priority %d but Priority scheduling is not enabled.", p)
	}
	s.prios.record(present, p, false)
	return p, nil
}

// genParams are the sampling parameters shared by chat and completions.
type genParams struct {
	maxTokens    *int
	defaultMax   int // when maxTokens is nil; 0 means max-model-len minus prompt
	n            int
	seed         *int64
	ignoreEOS    bool
	minTokens    int
	outputTokens int // from X-Sim-Output-Tokens; 0 if absent
	priority     int
	cacheSalt    string
}

// buildSpecs validates lengths and turns prompts into sequence specs, n per
// prompt. It also returns each sequence's prompt length.
func (s *Server) buildSpecs(idBase string, ordinal uint64, prompts [][]TokenID, p genParams, chat bool) ([]SequenceSpec, []int, *apiError) {
	var specs []SequenceSpec
	var lens []int
	for pi, prompt := range prompts {
		pl := len(prompt)
		if pl == 0 {
			return nil, nil, badRequest("The prompt must not be empty.")
		}
		what := "input prompt"
		if chat {
			what = "input messages"
		}
		if pl >= s.cfg.MaxModelLen {
			return nil, nil, badRequest("This model's maximum context length is %d tokens. However, your request has %d input tokens. Please reduce the length of the %s.",
				s.cfg.MaxModelLen, pl, what)
		}
		maxTokens := s.cfg.MaxModelLen - pl
		if p.maxTokens != nil {
			maxTokens = *p.maxTokens
			if maxTokens < 1 {
				return nil, nil, &apiError{status: 400, typ: "BadRequestError", param: "max_tokens",
					message: fmt.Sprintf("max_tokens must be at least 1, got %d.", maxTokens)}
			}
			// Compared without adding: pl+maxTokens overflows for a
			// max_tokens near 2^63 (pl < MaxModelLen here). The total is
			// printed in uint64, which holds it (both are below 2^63).
			if maxTokens > s.cfg.MaxModelLen-pl {
				return nil, nil, &apiError{status: 400, typ: "BadRequestError", param: "max_tokens",
					message: fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d output tokens and your prompt contains at least %d input tokens, for a total of at least %d tokens. Please reduce the length of the %s or the number of requested output tokens.",
						s.cfg.MaxModelLen, maxTokens, pl, uint64(pl)+uint64(maxTokens), what)}
			}
		} else if p.defaultMax > 0 {
			maxTokens = min(p.defaultMax, maxTokens)
		}
		promptHash := cacheSaltSeed("")
		for _, t := range prompt {
			promptHash = mix64(promptHash ^ uint64(t))
		}
		for c := 0; c < p.n; c++ {
			var seed uint64
			if p.seed != nil {
				seed = mix64(s.cfg.Seed ^ mix64(uint64(*p.seed)) ^ promptHash ^ mix64(uint64(pi*p.n+c)+1))
			} else {
				seed = mix64(s.cfg.Seed ^ mix64(ordinal) ^ promptHash ^ mix64(uint64(pi*p.n+c)+1))
			}
			specs = append(specs, SequenceSpec{
				ID:        fmt.Sprintf("%s-%d", idBase, len(specs)),
				Prompt:    prompt,
				Priority:  p.priority,
				MaxTokens: maxTokens,
				StopAfter: s.stopAfter(seed, p),
				Seed:      seed,
				CacheSalt: p.cacheSalt,
			})
			lens = append(lens, pl)
		}
	}
	return specs, lens, nil
}

// stopAfter decides when the model samples its end-of-sequence token: never
// with ignore_eos; at X-Sim-Output-Tokens when given; otherwise a length
// drawn (from the sequence's seed) uniformly in [mean/2, 3*mean/2], at least
// min_tokens+1.
func (s *Server) stopAfter(seed uint64, p genParams) int {
	if p.ignoreEOS || s.cfg.IgnoreEOS {
		return 0
	}
	if p.outputTokens > 0 {
		return p.outputTokens
	}
	mean := s.cfg.MeanOutputTokens
	lo := max(mean/2, 1)
	n := lo + int(mix64(seed^0xe05)%uint64(mean+1))
	return max(n, p.minTokens+1)
}

// requestID is vLLM's: the X-Request-Id header if present, else a
// deterministic hex ID.
func (s *Server) requestID(r *http.Request, prefix string, ordinal uint64) string {
	if id := r.Header.Get("X-Request-Id"); id != "" {
		return prefix + id
	}
	return fmt.Sprintf("%s%016x", prefix, mix64(s.cfg.Seed^mix64(ordinal+0x1d)))
}

// submit submits a job and, when admission fails, answers the error.
func (s *Server) submit(w http.ResponseWriter, j *job, specs []SequenceSpec) bool {
	err := s.eng.submit(j, specs)
	switch {
	case err == nil:
		return true
	case errors.Is(err, ErrQueueOverflow):
		writeAPIError(w, &apiError{status: http.StatusServiceUnavailable, typ: "Service Unavailable",
			message: "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."})
	case errors.Is(err, ErrQueuedTokens):
		writeAPIError(w, &apiError{status: http.StatusServiceUnavailable, typ: "Service Unavailable",
			message: "The engine has reached its prefill token backlog limit. Please try again later or on a different instance."})
	default:
		writeAPIError(w, &apiError{status: http.StatusInternalServerError, typ: "InternalServerError", message: err.Error()})
	}
	return false
}

// streamOptions is OpenAI's stream_options plus vLLM's continuous usage.
type streamOptions struct {
	IncludeUsage         bool `json:"include_usage"`
	ContinuousUsageStats bool `json:"continuous_usage_stats"`
}

// chatMessage is one message of a chat request.
type chatMessage struct {
	Role       string          `json:"role"`
	Content    json.RawMessage `json:"content"`
	ToolCalls  json.RawMessage `json:"tool_calls,omitempty"`
	ToolCallID string          `json:"tool_call_id,omitempty"`
	Name       string          `json:"name,omitempty"`
}

type chatRequest struct {
	Model               string          `json:"model"`
	Messages            []chatMessage   `json:"messages"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	Stream              bool            `json:"stream"`
	StreamOptions       *streamOptions  `json:"stream_options"`
	N                   *int            `json:"n"`
	Seed                *int64          `json:"seed"`
	Priority            *int            `json:"priority"`
	IgnoreEOS           bool            `json:"ignore_eos"`
	MinTokens           int             `json:"min_tokens"`
	Tools               json.RawMessage `json:"tools"`
	CacheSalt           string          `json:"cache_salt"`
}

// messageText flattens a message's content: a string, null, or an array of
// text parts (joined with newlines, as vLLM does).
func messageText(raw json.RawMessage) (string, *apiError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	if raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", badRequest("invalid message content: %v", err)
		}
		return s, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", badRequest("message content must be a string or an array of content parts: %v", err)
	}
	texts := make([]string, 0, len(parts))
	for _, p := range parts {
		if p.Type != "text" {
			return "", badRequest("content part type %q is not supported by this model", p.Type)
		}
		texts = append(texts, p.Text)
	}
	return strings.Join(texts, "\n"), nil
}

// renderChat applies the simulated chat template (ChatML): tools first, as a
// system message, then every message, then the assistant's generation
// prompt. It is prefix-stable: the rendering of a conversation starts with
// the rendering of any earlier turn of it plus the answer given then.
func renderChat(msgs []chatMessage, tools json.RawMessage) (string, *apiError) {
	if len(msgs) == 0 {
		return "", badRequest("messages must not be empty")
	}
	var b strings.Builder
	if t := bytes.TrimSpace(tools); len(t) > 0 && string(t) != "null" {
		var compact bytes.Buffer
		if err := json.Compact(&compact, t); err != nil {
			return "", badRequest("invalid tools: %v", err)
		}
		b.WriteString(imStart + "system\n# Tools\n\n")
		b.Write(compact.Bytes())
		b.WriteString(imEnd + "\n")
	}
	for _, m := range msgs {
		if m.Role == "" {
			return "", badRequest("every message needs a role")
		}
		text, err := messageText(m.Content)
		if err != nil {
			return "", err
		}
		b.WriteString(imStart)
		b.WriteString(m.Role)
		b.WriteByte('\n')
		b.WriteString(text)
		if tc := bytes.TrimSpace(m.ToolCalls); len(tc) > 0 && string(tc) != "null" {
			var compact bytes.Buffer
			if err := json.Compact(&compact, tc); err != nil {
				return "", badRequest("invalid tool_calls: %v", err)
			}
			b.WriteString("\n<tool_call>")
			b.Write(compact.Bytes())
			b.WriteString("</tool_call>")
		}
		b.WriteString(imEnd + "\n")
	}
	b.WriteString(imStart + "assistant\n")
	return b.String(), nil
}

func (s *Server) handleChat(w http.ResponseWriter, r *http.Request) {
	var req chatRequest
	if err := decodeBody(w, r, &req); err != nil {
		writeAPIError(w, err)
		return
	}
	if err := s.checkModel(req.Model); err != nil {
		writeAPIError(w, err)
		return
	}
	if req.StreamOptions != nil && !req.Stream {
		writeAPIError(w, badRequest("Stream options can only be defined when `stream=True`."))
		return
	}
	text, aerr := renderChat(req.Messages, req.Tools)
	if aerr != nil {
		writeAPIError(w, aerr)
		return
	}
	maxTokens := req.MaxCompletionTokens
	if maxTokens == nil {
		maxTokens = req.MaxTokens
	}
	s.generate(w, r, true, [][]TokenID{Tokenize(text)}, req.Stream, req.StreamOptions, genRequest{
		n: req.N, maxTokens: maxTokens, seed: req.Seed, priority: req.Priority, ignoreEOS: req.IgnoreEOS,
		minTokens: req.MinTokens, cacheSalt: req.CacheSalt,
	})
}

type completionRequest struct {
	Model         string          `json:"model"`
	Prompt        json.RawMessage `json:"prompt"`
	MaxTokens     *int            `json:"max_tokens"`
	Stream        bool            `json:"stream"`
	StreamOptions *streamOptions  `json:"stream_options"`
	N             *int            `json:"n"`
	Seed          *int64          `json:"seed"`
	Priority      *int            `json:"priority"`
	IgnoreEOS     bool            `json:"ignore_eos"`
	MinTokens     int             `json:"min_tokens"`
	CacheSalt     string          `json:"cache_salt"`
}

// completionsDefaultMaxTokens is the OpenAI completions default max_tokens.
const completionsDefaultMaxTokens = 16

// parsePrompts reads an OpenAI prompt/input: a string, an array of strings,
// an array of token IDs, or an array of arrays of token IDs.
func parsePrompts(raw json.RawMessage, field string) ([][]TokenID, *apiError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, badRequest("%s is required", field)
	}
	var one string
	if json.Unmarshal(raw, &one) == nil {
		return [][]TokenID{Tokenize(one)}, nil
	}
	var many []string
	if json.Unmarshal(raw, &many) == nil {
		if len(many) == 0 {
			return nil, badRequest("%s must not be empty", field)
		}
		out := make([][]TokenID, len(many))
		for i, p := range many {
			out[i] = Tokenize(p)
		}
		return out, nil
	}
	var ids []int64
	if json.Unmarshal(raw, &ids) == nil {
		t, err := tokenIDs(ids)
		if err != nil {
			return nil, err
		}
		return [][]TokenID{t}, nil
	}
	var idss [][]int64
	if json.Unmarshal(raw, &idss) == nil && len(idss) > 0 {
		out := make([][]TokenID, len(idss))
		for i, ids := range idss {
			t, err := tokenIDs(ids)
			if err != nil {
				return nil, err
			}
			out[i] = t
		}
		return out, nil
	}
	return nil, badRequest("%s must be a string, an array of strings, an array of token IDs or an array of arrays of token IDs", field)
}

func tokenIDs(ids []int64) ([]TokenID, *apiError) {
	out := make([]TokenID, len(ids))
	for i, id := range ids {
		if id < 0 || id >= VocabSize {
			return nil, badRequest("Token id %d is out of vocabulary", id)
		}
		out[i] = TokenID(id)
	}
	return out, nil
}

func (s *Server) handleCompletions(w http.ResponseWriter, r *http.Request) {
	var req completionRequest
	if err := decodeBody(w, r, &req); err != nil {
		writeAPIError(w, err)
		return
	}
	if err := s.checkModel(req.Model); err != nil {
		writeAPIError(w, err)
		return
	}
	if req.StreamOptions != nil && !req.Stream {
		writeAPIError(w, badRequest("Stream options can only be defined when `stream=True`."))
		return
	}
	prompts, aerr := parsePrompts(req.Prompt, "prompt")
	if aerr != nil {
		writeAPIError(w, aerr)
		return
	}
	s.generate(w, r, false, prompts, req.Stream, req.StreamOptions, genRequest{
		n: req.N, maxTokens: req.MaxTokens, defaultMax: completionsDefaultMaxTokens, seed: req.Seed,
		priority: req.Priority, ignoreEOS: req.IgnoreEOS, minTokens: req.MinTokens, cacheSalt: req.CacheSalt,
	})
}

// genRequest is the part of a chat or completions request generate needs.
type genRequest struct {
	n          *int
	maxTokens  *int
	defaultMax int
	seed       *int64
	priority   *int
	ignoreEOS  bool
	minTokens  int
	cacheSalt  string
}

// generate runs a chat or completions request through the engine.
func (s *Server) generate(w http.ResponseWriter, r *http.Request, chat bool, prompts [][]TokenID, stream bool,
	opts *streamOptions, gr genRequest) {
	n := 1
	if gr.n != nil {
		n = *gr.n
		if n < 1 {
			writeAPIError(w, &apiError{status: 400, typ: "BadRequestError", param: "n", message: fmt.Sprintf("n must be at least 1, got %d.", n)})
			return
		}
	}
	if gr.minTokens < 0 {
		writeAPIError(w, badRequest("min_tokens must be greater than or equal to 0, got %d.", gr.minTokens))
		return
	}
	if gr.maxTokens != nil && gr.minTokens > *gr.maxTokens {
		writeAPIError(w, badRequest("min_tokens must be less than or equal to max_tokens=%d, got %d.", *gr.maxTokens, gr.minTokens))
		return
	}
	priority, aerr := s.priorityOf(r, gr.priority)
	if aerr != nil {
		writeAPIError(w, aerr)
		return
	}
	outTokens := 0
	if h := r.Header.Get("X-Sim-Output-Tokens"); h != "" {
		v, err := strconv.Atoi(h)
		if err != nil || v < 1 {
			writeAPIError(w, badRequest("invalid X-Sim-Output-Tokens header %q: must be a positive integer", h))
			return
		}
		outTokens = v
	}
	prefix := "cmpl-"
	if chat {
		prefix = "chatcmpl-"
	}
	ordinal := s.ordinal.Add(1)
	id := s.requestID(r, prefix, ordinal)
	specs, lens, aerr := s.buildSpecs(id, ordinal, prompts, genParams{
		maxTokens: gr.maxTokens, defaultMax: gr.defaultMax, n: n, seed: gr.seed, ignoreEOS: gr.ignoreEOS,
		minTokens: gr.minTokens, outputTokens: outTokens, priority: priority, cacheSalt: gr.cacheSalt,
	}, chat)
	if aerr != nil {
		writeAPIError(w, aerr)
		return
	}
	j := newJob(stream, lens)
	if !s.submit(w, j, specs) {
		return
	}
	defer s.eng.abort(j) // no-op once the job is complete
	if r.Header.Get("X-Request-Id") != "" {
		w.Header().Set("X-Request-Id", r.Header.Get("X-Request-Id"))
	}
	// Prompt tokens count once per prompt, however many choices share it.
	promptTokens := 0
	for i, l := range lens {
		if i%n == 0 {
			promptTokens += l
		}
	}
	created := time.Now().Unix()
	if stream {
		s.stream(w, r, j, chat, id, created, promptTokens, opts)
		return
	}
	for {
		select {
		case <-r.Context().Done():
			return
		case <-j.notify:
		}
		done, err := j.state()
		if err != nil {
			writeAPIError(w, &apiError{status: 500, typ: "InternalServerError", message: err.Error()})
			return
		}
		if done {
			break
		}
	}
	if cut, ok := cutAfterFrom(r.Context()); ok && cut >= 0 {
		panic(http.ErrAbortHandler) // a cut non-streaming answer never arrives
	}
	s.writeFinal(w, j, chat, id, created, promptTokens)
}

// writeFinal answers a complete non-streaming request.
func (s *Server) writeFinal(w http.ResponseWriter, j *job, chat bool, id string, created int64, promptTokens int) {
	j.mu.Lock()
	defer j.mu.Unlock()
	completion, cached := 0, 0
	choices := make([]map[string]any, len(j.choices))
	for i, c := range j.choices {
		completion += c.numTokens
		if i == 0 {
			cached = c.cachedTokens
		}
		ch := map[string]any{"index": i, "logprobs": nil, "finish_reason": string(c.reason), "stop_reason": nil}
		if chat {
			ch["message"] = map[string]any{"role": "assistant", "content": c.text.String(), "tool_calls": []any{}}
		} else {
			ch["text"] = c.text.String()
		}
		choices[i] = ch
	}
	obj := "text_completion"
	if chat {
		obj = "chat.completion"
	}
	usage := map[string]any{"prompt_tokens": promptTokens, "total_tokens": promptTokens + completion, "completion_tokens": completion}
	if cached > 0 {
		usage["prompt_tokens_details"] = map[string]int{"cached_tokens": cached}
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"id": id, "object": obj, "created": created, "model": s.names[0], "choices": choices, "usage": usage,
	})
}

// stream relays a job's tokens as server-sent events, one chunk per token
// (plus the role chunk of each chat choice), then the usage chunk when asked
// for, then [DONE]. Tokens of several steps that arrive together go out in
// one write.
func (s *Server) stream(w http.ResponseWriter, r *http.Request, j *job, chat bool, id string, created int64,
	promptTokens int, opts *streamOptions) {
	includeUsage := opts != nil && opts.IncludeUsage
	cw := newChunkWriter(chat, id, s.names[0], created, promptTokens, opts != nil && opts.ContinuousUsageStats)
	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	if err := rc.Flush(); err != nil {
		return
	}
	cut, cutting := cutAfterFrom(r.Context())
	if cutting && cut == 0 {
		panic(http.ErrAbortHandler)
	}
	chunks := 0
	started := make([]bool, len(j.choices))
	completion := make([]int, len(j.choices))
	var (
		buf    []byte
		events []jobEvent
	)
	total := func() int {
		t := 0
		for _, c := range completion {
			t += c
		}
		return t
	}
	// emit appends one chunk and reports whether the stream must be cut now.
	emit := func(chunk []byte) bool {
		buf = chunk
		chunks++
		return cutting && chunks >= cut
	}
	for {
		select {
		case <-r.Context().Done():
			return
		case <-j.notify:
		}
		var (
			done bool
			err  error
		)
		events, done, err = j.take(events)
		buf = buf[:0]
		for _, ev := range events {
			if chat && !started[ev.choice] {
				started[ev.choice] = true
				if emit(cw.role(buf, ev.choice, total())) {
					s.cut(rc, w, buf)
				}
			}
			if !ev.noText {
				completion[ev.choice]++
			}
			if emit(cw.token(buf, ev.choice, ev.text, ev.finish, total())) {
				s.cut(rc, w, buf)
			}
		}
		if err != nil {
			buf = append(buf, "data: "...)
			buf = append(buf, errorBody(&apiError{status: 500, typ: "InternalServerError", message: err.Error()})...)
			buf = append(buf, "\n\n"...)
			buf = append(buf, doneEvent...)
			_, _ = w.Write(buf)
			rc.Flush()
			return
		}
		if done {
			if includeUsage {
				j.mu.Lock()
				cached := j.choices[0].cachedTokens
				j.mu.Unlock()
				if emit(cw.usage(buf, total(), cached)) {
					s.cut(rc, w, buf)
				}
			}
			buf = append(buf, doneEvent...)
		}
		if len(buf) > 0 {
			if _, err := w.Write(buf); err != nil {
				return
			}
			if err := rc.Flush(); err != nil {
				return
			}
		}
		if done {
			return
		}
	}
}

// cut writes what the stream has so far and drops the connection.
func (s *Server) cut(rc *http.ResponseController, w http.ResponseWriter, buf []byte) {
	_, _ = w.Write(buf)
	rc.Flush()
	s.log.Debug("fault: stream cut")
	panic(http.ErrAbortHandler)
}
