package vllmsim

// protocols.go serves the agents' protocols as vLLM 0.29 does: the
// Anthropic Messages API (POST /v1/messages, with Anthropic's SSE events,
// usage and error shape) and the OpenAI Responses API (POST /v1/responses
// with response.* events, stored Responses per engine for GET
// /v1/responses/{id} and previous_response_id, cancel of a stored one
// answered as vLLM answers a synchronous Response). Prompts are rendered
// by the chat template of chat completions, so prefix caching and usage
// behave the same.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"
)

func (s *Server) protocolRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /v1/messages", s.handleMessages)
	mux.HandleFunc("POST /v1/responses", s.handleResponses)
	mux.HandleFunc("GET /v1/responses/{id}", s.handleGetResponse)
	mux.HandleFunc("POST /v1/responses/{id}/cancel", s.handleCancelResponse)
}

// run submits one prompt and waits for it (non-streaming) or returns the
// job to stream. It answers failures through fail.
func (s *Server) run(w http.ResponseWriter, r *http.Request, prefix, text string, maxTokens *int, stream bool, fail func(*apiError)) (*job, string, int, bool) {
	priority, aerr := s.priorityOf(r, nil)
	if aerr != nil {
		fail(aerr)
		return nil, "", 0, false
	}
	outTokens := 0
	if h := r.Header.Get("X-Sim-Output-Tokens"); h != "" {
		if _, err := fmt.Sscan(h, &outTokens); err != nil || outTokens < 1 {
			fail(badRequest("invalid X-Sim-Output-Tokens header %q: must be a positive integer", h))
			return nil, "", 0, false
		}
	}
	ordinal := s.ordinal.Add(1)
	id := s.requestID(r, prefix, ordinal)
	specs, lens, aerr := s.buildSpecs(id, ordinal, [][]TokenID{Tokenize(text)}, genParams{
		maxTokens: maxTokens, n: 1, outputTokens: outTokens, priority: priority}, true)
	if aerr != nil {
		fail(aerr)
		return nil, "", 0, false
	}
	j := newJob(stream, lens)
	if err := s.eng.submit(j, specs); err != nil {
		fail(&apiError{status: http.StatusServiceUnavailable, typ: "Service Unavailable", message: "The engine is currently busy: " + err.Error()})
		return nil, "", 0, false
	}
	return j, id, lens[0], true
}

// wait waits for a non-streaming job (false: the client left, or it failed
// and fail answered).
func wait(r *http.Request, j *job, fail func(*apiError)) bool {
	for {
		select {
		case <-r.Context().Done():
			return false
		case <-j.notify:
		}
		done, err := j.state()
		if err != nil {
			fail(&apiError{status: 500, typ: "InternalServerError", message: err.Error()})
			return false
		}
		if done {
			return true
		}
	}
}

// relay streams a job's tokens: onToken per token, then onDone with the
// completion tokens, cached tokens and finish reason; false when the
// client left. The message_delta of Anthropic streams repeats the input
// counts (known once the prefill is scheduled).
func relay(w http.ResponseWriter, r *http.Request, j *job, first []byte, onToken func(b []byte, text string) []byte,
	onDone func(b []byte, completion, cached int, reason FinishReason) []byte) {
	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(first)
	if rc.Flush() != nil {
		return
	}
	var events []jobEvent
	completion := 0
	var reason FinishReason
	for {
		select {
		case <-r.Context().Done():
			return
		case <-j.notify:
		}
		var done bool
		var err error
		events, done, err = j.take(events)
		var buf []byte
		for _, ev := range events {
			if !ev.noText {
				completion++
				buf = onToken(buf, ev.text)
			}
			if ev.finish != "" {
				reason = ev.finish
			}
		}
		if err != nil {
			buf = sseEvent(buf, "error", map[string]any{"type": "error", "error": map[string]any{"type": "api_error", "message": err.Error()}})
			_, _ = w.Write(buf)
			rc.Flush()
			return
		}
		if done {
			j.mu.Lock()
			cached := j.choices[0].cachedTokens
			j.mu.Unlock()
			buf = onDone(buf, completion, cached, reason)
		}
		if len(buf) > 0 {
			if _, err := w.Write(buf); err != nil || rc.Flush() != nil {
				return
			}
		}
		if done {
			return
		}
	}
}

// sseEvent appends one named SSE event.
func sseEvent(b []byte, name string, v any) []byte {
	data, _ := json.Marshal(v)
	b = append(b, "event: "...)
	b = append(b, name...)
	b = append(b, "\ndata: "...)
	b = append(b, data...)
	return append(b, "\n\n"...)
}

// Anthropic Messages.

type anthropicRequest struct {
	Model     string             `json:"model"`
	MaxTokens *int               `json:"max_tokens"`
	Messages  []anthropicMessage `json:"messages"`
	System    json.RawMessage    `json:"system"`
	Tools     json.RawMessage    `json:"tools"`
	// ToolChoice forcing a tool makes the answer a tool_use block
	// (tooluse.go).
	ToolChoice json.RawMessage `json:"tool_choice"`
	Stream     bool            `json:"stream"`
}

type anthropicMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// anthropicError answers in Anthropic's error shape, as vLLM's Messages
// endpoint does.
func anthropicError(w http.ResponseWriter, e *apiError) {
	typ := "invalid_request_error"
	switch {
	case e.status == http.StatusNotFound:
		typ = "not_found_error"
	case e.status == http.StatusServiceUnavailable:
		typ = "overloaded_error"
	case e.status >= 500:
		typ = "api_error"
	}
	b, _ := json.Marshal(map[string]any{"type": "error", "error": map[string]any{"type": typ, "message": e.message}})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(e.status)
	_, _ = w.Write(b)
}

// blockText flattens Anthropic content: a string or text, tool_use and
// tool_result blocks (images are not supported by the simulated model).
func blockText(raw json.RawMessage) (string, *apiError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || raw[0] == '"' || string(raw) == "null" {
		return messageText(raw)
	}
	var blocks []struct {
		Type    string          `json:"type"`
		Text    string          `json:"text"`
		Input   json.RawMessage `json:"input"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(raw, &blocks); err != nil {
		return "", badRequest("content must be a string or an array of content blocks: %v", err)
	}
	var parts []string
	for _, b := range blocks {
		switch b.Type {
		case "text":
			parts = append(parts, b.Text)
		case "tool_use":
			parts = append(parts, "<tool_call>"+string(b.Input)+"</tool_call>")
		case "tool_result":
			t, err := blockText(b.Content)
			if err != nil {
				return "", err
			}
			parts = append(parts, "<tool_response>"+t+"</tool_response>")
		default:
			return "", badRequest("content block type %q is not supported by this model", b.Type)
		}
	}
	return strings.Join(parts, "\n"), nil
}

func anthropicStop(r FinishReason) string {
	if r == FinishLength {
		return "max_tokens"
	}
	return "end_turn"
}

func anthropicUsage(prompt, completion, cached int) map[string]any {
	return map[string]any{"input_tokens": prompt - cached, "output_tokens": completion,
		"cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
}

func (s *Server) handleMessages(w http.ResponseWriter, r *http.Request) {
	fail := func(e *apiError) { anthropicError(w, e) }
	var req anthropicRequest
	if err := decodeBody(w, r, &req); err != nil {
		fail(err)
		return
	}
	if err := s.checkModel(req.Model); err != nil {
		fail(err)
		return
	}
	if req.MaxTokens == nil {
		fail(badRequest("max_tokens: Field required"))
		return
	}
	var msgs []chatMessage
	if sys := bytes.TrimSpace(req.System); len(sys) > 0 && string(sys) != "null" {
		t, err := blockText(sys)
		if err != nil {
			fail(err)
			return
		}
		msgs = append(msgs, chatMessage{Role: "system", Content: mustJSON(t)})
	}
	for _, m := range req.Messages {
		t, err := blockText(m.Content)
		if err != nil {
			fail(err)
			return
		}
		msgs = append(msgs, chatMessage{Role: m.Role, Content: mustJSON(t)})
	}
	text, aerr := renderChat(msgs, req.Tools)
	if aerr != nil {
		fail(aerr)
		return
	}
	j, id, prompt, ok := s.run(w, r, "msg_", text, req.MaxTokens, req.Stream, fail)
	if !ok {
		return
	}
	defer s.eng.abort(j)
	model := req.Model
	toolName, toolInput, toolUse := forcedTool(req.Tools, req.ToolChoice, false)
	toolID := "toolu_" + strings.TrimPrefix(id, "msg_")
	stop := func(r FinishReason) string {
		if toolUse {
			return "tool_use"
		}
		return anthropicStop(r)
	}
	if !req.Stream {
		if !wait(r, j, fail) {
			return
		}
		j.mu.Lock()
		c := j.choices[0]
		block := map[string]any{"type": "text", "text": c.text.String()}
		if toolUse {
			block = map[string]any{"type": "tool_use", "id": toolID, "name": toolName, "input": toolInput}
		}
		out := map[string]any{"id": id, "type": "message", "role": "assistant", "model": model,
			"content":     []any{block},
			"stop_reason": stop(c.reason), "stop_sequence": nil, "usage": anthropicUsage(prompt, c.numTokens, c.cachedTokens)}
		j.mu.Unlock()
		writeJSON(w, http.StatusOK, out)
		return
	}
	j.mu.Lock()
	cached0 := j.choices[0].cachedTokens
	j.mu.Unlock()
	var first []byte
	first = sseEvent(first, "message_start", map[string]any{"type": "message_start", "message": map[string]any{
		"id": id, "type": "message", "role": "assistant", "model": model, "content": []any{},
		"stop_reason": nil, "stop_sequence": nil, "usage": anthropicUsage(prompt, 0, cached0)}})
	startBlock := map[string]any{"type": "text", "text": ""}
	if toolUse {
		startBlock = map[string]any{"type": "tool_use", "id": toolID, "name": toolName, "input": map[string]any{}}
	}
	first = sseEvent(first, "content_block_start", map[string]any{"type": "content_block_start", "index": 0,
		"content_block": startBlock})
	first = sseEvent(first, "ping", map[string]any{"type": "ping"})
	pieces := jsonPieces{rest: string(toolInput)}
	inputDelta := func(b []byte, piece string) []byte {
		if piece == "" {
			return b
		}
		return sseEvent(b, "content_block_delta", map[string]any{"type": "content_block_delta", "index": 0,
			"delta": map[string]any{"type": "input_json_delta", "partial_json": piece}})
	}
	relay(w, r, j, first, func(b []byte, t string) []byte {
		if toolUse {
			return inputDelta(b, pieces.next())
		}
		return sseEvent(b, "content_block_delta", map[string]any{"type": "content_block_delta", "index": 0,
			"delta": map[string]any{"type": "text_delta", "text": t}})
	}, func(b []byte, completion, cached int, reason FinishReason) []byte {
		if toolUse {
			b = inputDelta(b, pieces.rest)
		}
		b = sseEvent(b, "content_block_stop", map[string]any{"type": "content_block_stop", "index": 0})
		b = sseEvent(b, "message_delta", map[string]any{"type": "message_delta",
			"delta": map[string]any{"stop_reason": stop(reason), "stop_sequence": nil},
			"usage": anthropicUsage(prompt, completion, cached)})
		return sseEvent(b, "message_stop", map[string]any{"type": "message_stop"})
	})
}

func mustJSON(v any) json.RawMessage {
	b, _ := json.Marshal(v)
	return b
}

// OpenAI Responses.

// responseStore holds this engine's Responses (vLLM keeps them in the
// engine's memory: another engine does not know them).
type responseStore struct {
	mu sync.Mutex
	m  map[string]*storedResponse
}

type storedResponse struct {
	obj map[string]any
	// conversation is the rendered messages a follow-up continues.
	conversation []chatMessage
}

func (st *responseStore) get(id string) *storedResponse {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.m[id]
}

func (st *responseStore) put(id string, r *storedResponse) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.m == nil {
		st.m = map[string]*storedResponse{}
	}
	st.m[id] = r
}

type responsesRequest struct {
	Model              string          `json:"model"`
	Input              json.RawMessage `json:"input"`
	Instructions       string          `json:"instructions"`
	MaxOutputTokens    *int            `json:"max_output_tokens"`
	Tools              json.RawMessage `json:"tools"`
	ToolChoice         json.RawMessage `json:"tool_choice"` // forcing a function: a function_call (tooluse.go)
	Stream             bool            `json:"stream"`
	Store              *bool           `json:"store"`
	PreviousResponseID string          `json:"previous_response_id"`
}

// inputMessages reads input: a string (one user message) or an array of
// message items whose content is a string or input_text/output_text parts.
func inputMessages(raw json.RawMessage) ([]chatMessage, *apiError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	if raw[0] == '"' {
		return []chatMessage{{Role: "user", Content: raw}}, nil
	}
	var items []struct {
		Type    string          `json:"type"`
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, badRequest("input must be a string or an array of items: %v", err)
	}
	var out []chatMessage
	for _, it := range items {
		if it.Type != "" && it.Type != "message" {
			return nil, badRequest("input item type %q is not supported by this model", it.Type)
		}
		c := bytes.TrimSpace(it.Content)
		if len(c) > 0 && c[0] == '[' {
			var parts []struct {
				Type string `json:"type"`
				Text string `json:"text"`
			}
			if err := json.Unmarshal(c, &parts); err != nil {
				return nil, badRequest("invalid content: %v", err)
			}
			var texts []string
			for _, p := range parts {
				if p.Type != "input_text" && p.Type != "output_text" && p.Type != "text" {
					return nil, badRequest("content part type %q is not supported by this model", p.Type)
				}
				texts = append(texts, p.Text)
			}
			c = mustJSON(strings.Join(texts, "\n"))
		}
		out = append(out, chatMessage{Role: it.Role, Content: c})
	}
	return out, nil
}

func responsesUsage(prompt, completion, cached int) map[string]any {
	return map[string]any{"input_tokens": prompt, "input_tokens_details": map[string]any{"cached_tokens": cached},
		"output_tokens": completion, "output_tokens_details": map[string]any{"reasoning_tokens": 0}, "total_tokens": prompt + completion}
}

func (s *Server) handleResponses(w http.ResponseWriter, r *http.Request) {
	fail := func(e *apiError) { writeAPIError(w, e) }
	var req responsesRequest
	if err := decodeBody(w, r, &req); err != nil {
		fail(err)
		return
	}
	if err := s.checkModel(req.Model); err != nil {
		fail(err)
		return
	}
	var msgs []chatMessage
	if req.PreviousResponseID != "" {
		prev := s.responses.get(req.PreviousResponseID)
		if prev == nil {
			fail(&apiError{status: http.StatusNotFound, typ: "invalid_request_error", param: "previous_response_id",
				message: fmt.Sprintf("Response with id '%s' not found.", req.PreviousResponseID)})
			return
		}
		msgs = append(msgs, prev.conversation...)
	} else if req.Instructions != "" {
		msgs = append(msgs, chatMessage{Role: "system", Content: mustJSON(req.Instructions)})
	}
	in, aerr := inputMessages(req.Input)
	if aerr != nil {
		fail(aerr)
		return
	}
	msgs = append(msgs, in...)
	text, aerr := renderChat(msgs, req.Tools)
	if aerr != nil {
		fail(aerr)
		return
	}
	j, id, prompt, ok := s.run(w, r, "resp_", text, req.MaxOutputTokens, req.Stream, fail)
	if !ok {
		return
	}
	defer s.eng.abort(j)
	store := req.Store == nil || *req.Store
	created := time.Now().Unix()
	msgID := "msg_" + strings.TrimPrefix(id, "resp_")
	toolName, toolInput, toolUse := forcedTool(req.Tools, req.ToolChoice, true)
	callItem := func(status, args string) map[string]any {
		return map[string]any{"id": "fc_" + strings.TrimPrefix(id, "resp_"), "type": "function_call", "status": status,
			"call_id": "call_" + strings.TrimPrefix(id, "resp_"), "name": toolName, "arguments": args}
	}
	if toolUse {
		msgID = "fc_" + strings.TrimPrefix(id, "resp_")
	}
	obj := func(status string, outText string, usage any) map[string]any {
		var output []any
		if (status == "completed" || status == "incomplete") && toolUse {
			output = []any{callItem("completed", string(toolInput))}
		} else if status == "completed" || status == "incomplete" {
			output = []any{map[string]any{"id": msgID, "type": "message", "role": "assistant", "status": "completed",
				"content": []any{map[string]any{"type": "output_text", "text": outText, "annotations": []any{}}}}}
		} else {
			output = []any{}
		}
		var prev any
		if req.PreviousResponseID != "" {
			prev = req.PreviousResponseID
		}
		return map[string]any{"id": id, "object": "response", "created_at": created, "model": req.Model, "status": status,
			"output": output, "usage": usage, "previous_response_id": prev, "parallel_tool_calls": true,
			"tool_choice": "auto", "tools": []any{}, "store": store, "error": nil, "incomplete_details": nil}
	}
	finish := func(outText string, completion, cached int, reason FinishReason) map[string]any {
		status := "completed"
		if reason == FinishLength {
			status = "incomplete"
		}
		o := obj(status, outText, responsesUsage(prompt, completion, cached))
		if toolUse {
			outText = "<tool_call>" + string(toolInput) + "</tool_call>"
		}
		if store {
			conv := append(append([]chatMessage{}, msgs...), chatMessage{Role: "assistant", Content: mustJSON(outText)})
			s.responses.put(id, &storedResponse{obj: o, conversation: conv})
		}
		return o
	}
	if !req.Stream {
		if !wait(r, j, fail) {
			return
		}
		j.mu.Lock()
		c := j.choices[0]
		out, n, cached, reason := c.text.String(), c.numTokens, c.cachedTokens, c.reason
		j.mu.Unlock()
		writeJSON(w, http.StatusOK, finish(out, n, cached, reason))
		return
	}
	seq := 0
	ev := func(b []byte, typ string, fields map[string]any) []byte {
		fields["type"], fields["sequence_number"] = typ, seq
		seq++
		return sseEvent(b, typ, fields)
	}
	var first []byte
	first = ev(first, "response.created", map[string]any{"response": obj("in_progress", "", nil)})
	first = ev(first, "response.in_progress", map[string]any{"response": obj("in_progress", "", nil)})
	if toolUse {
		first = ev(first, "response.output_item.added", map[string]any{"output_index": 0, "item": callItem("in_progress", "")})
		pieces := jsonPieces{rest: string(toolInput)}
		argsDelta := func(b []byte, piece string) []byte {
			if piece == "" {
				return b
			}
			return ev(b, "response.function_call_arguments.delta", map[string]any{"item_id": msgID, "output_index": 0, "delta": piece})
		}
		relay(w, r, j, first, func(b []byte, _ string) []byte { return argsDelta(b, pieces.next()) },
			func(b []byte, completion, cached int, reason FinishReason) []byte {
				b = argsDelta(b, pieces.rest)
				b = ev(b, "response.function_call_arguments.done", map[string]any{"item_id": msgID, "output_index": 0,
					"name": toolName, "arguments": string(toolInput)})
				b = ev(b, "response.output_item.done", map[string]any{"output_index": 0, "item": callItem("completed", string(toolInput))})
				o := finish("", completion, cached, reason)
				name := "response.completed"
				if o["status"] == "incomplete" {
					name = "response.incomplete"
				}
				return ev(b, name, map[string]any{"response": o})
			})
		return
	}
	first = ev(first, "response.output_item.added", map[string]any{"output_index": 0, "item": map[string]any{
		"id": msgID, "type": "message", "role": "assistant", "status": "in_progress", "content": []any{}}})
	first = ev(first, "response.content_part.added", map[string]any{"item_id": msgID, "output_index": 0, "content_index": 0,
		"part": map[string]any{"type": "output_text", "text": "", "annotations": []any{}}})
	var full strings.Builder
	relay(w, r, j, first, func(b []byte, t string) []byte {
		full.WriteString(t)
		return ev(b, "response.output_text.delta", map[string]any{"item_id": msgID, "output_index": 0, "content_index": 0,
			"delta": t, "logprobs": []any{}})
	}, func(b []byte, completion, cached int, reason FinishReason) []byte {
		t := full.String()
		part := map[string]any{"type": "output_text", "text": t, "annotations": []any{}}
		b = ev(b, "response.output_text.done", map[string]any{"item_id": msgID, "output_index": 0, "content_index": 0, "text": t, "logprobs": []any{}})
		b = ev(b, "response.content_part.done", map[string]any{"item_id": msgID, "output_index": 0, "content_index": 0, "part": part})
		b = ev(b, "response.output_item.done", map[string]any{"output_index": 0, "item": map[string]any{
			"id": msgID, "type": "message", "role": "assistant", "status": "completed", "content": []any{part}}})
		o := finish(t, completion, cached, reason)
		name := "response.completed"
		if o["status"] == "incomplete" {
			name = "response.incomplete"
		}
		return ev(b, name, map[string]any{"response": o})
	})
}

func (s *Server) handleGetResponse(w http.ResponseWriter, r *http.Request) {
	st := s.responses.get(r.PathValue("id"))
	if st == nil {
		writeAPIError(w, &apiError{status: http.StatusNotFound, typ: "invalid_request_error",
			message: fmt.Sprintf("Response with id '%s' not found.", r.PathValue("id"))})
		return
	}
	writeJSON(w, http.StatusOK, st.obj)
}

// handleCancelResponse answers as vLLM does for a Response that is not a
// background one (every Response of the simulator completes in its
// request).
func (s *Server) handleCancelResponse(w http.ResponseWriter, r *http.Request) {
	if s.responses.get(r.PathValue("id")) == nil {
		writeAPIError(w, &apiError{status: http.StatusNotFound, typ: "invalid_request_error",
			message: fmt.Sprintf("Response with id '%s' not found.", r.PathValue("id"))})
		return
	}
	writeAPIError(w, badRequest("Cannot cancel a synchronous response."))
}
