package vllmsim

import (
	"context"
	"encoding/json"
	"math"
	"net/http"
	"strings"
	"testing"
)

// A max_tokens near 2^63 is refused with vLLM's context-length message:
// the check compares without adding (prompt + max_tokens overflowed and
// the request was accepted).
func TestHTTPMaxTokensOverflowRefused(t *testing.T) {
	s := startSim(t, func(c *Config) { c.MaxModelLen = 1000; c.NumGPUBlocks = 100 })
	for _, tc := range []struct {
		path string
		body map[string]any
	}{
		{"/v1/chat/completions", chatBody("hi", map[string]any{"max_tokens": int64(math.MaxInt64)})},
		{"/v1/chat/completions", chatBody("hi", map[string]any{"max_completion_tokens": int64(math.MaxInt64)})},
		{"/v1/chat/completions", chatBody("hi", map[string]any{"max_tokens": int64(math.MaxInt64 - 3)})},
		{"/v1/completions", map[string]any{"prompt": "Once upon a time", "max_tokens": int64(math.MaxInt64)}},
	} {
		var e errorResponse
		s.do(tc.path, tc.body, http.StatusBadRequest, &e)
		if !strings.Contains(e.Error.Message, "maximum context length is 1000 tokens. However, you requested") ||
			e.Error.Param == nil || *e.Error.Param != "max_tokens" || e.Error.Type != "BadRequestError" {
			t.Errorf("%s %v: %+v", tc.path, tc.body, e)
		}
		if strings.Contains(e.Error.Message, "total of at least -") {
			t.Errorf("the total overflowed in the message: %s", e.Error.Message)
		}
	}
	// The scheduler refuses such a sequence too.
	sch, err := NewScheduler(testEngine(nil))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sch.Add(SequenceSpec{ID: "big", Prompt: []TokenID{1, 2, 3}, MaxTokens: math.MaxInt}); err == nil {
		t.Error("Add accepted max tokens MaxInt")
	}
}

// n choices: the non-streaming answer has n choices with their indexes and
// a usage counting all of them (the prompt once); a stream carries every
// choice's chunks with its index, each choice's finish_reason on its last
// token's chunk, and its usage chunk the sum.
func TestHTTPNChoices(t *testing.T) {
	s := startSim(t, nil)
	const n, maxTokens = 3, 5
	body := chatBody("Count the choices.", map[string]any{"n": n, "max_tokens": maxTokens, "ignore_eos": true})
	var resp chatResponse
	s.do("/v1/chat/completions", body, http.StatusOK, &resp)
	if len(resp.Choices) != n {
		t.Fatalf("%d choices, want %d", len(resp.Choices), n)
	}
	for i, c := range resp.Choices {
		if c.Index != i || c.FinishReason != "length" || c.Message.Content == "" {
			t.Errorf("choice %d: %+v", i, c)
		}
	}
	var single chatResponse
	s.do("/v1/chat/completions", chatBody("Count the choices.", map[string]any{"max_tokens": maxTokens, "ignore_eos": true}), http.StatusOK, &single)
	if resp.Usage.CompletionTokens != n*maxTokens || resp.Usage.PromptTokens != single.Usage.PromptTokens ||
		resp.Usage.TotalTokens != resp.Usage.PromptTokens+n*maxTokens {
		t.Errorf("usage %+v, want %d completion tokens and the prompt (%d) once", resp.Usage, n*maxTokens, single.Usage.PromptTokens)
	}

	body["stream"] = true
	body["stream_options"] = map[string]any{"include_usage": true}
	r, err := s.post(context.Background(), "/v1/chat/completions", body)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	events, err := sseEvents(r.Body)
	if err != nil {
		t.Fatal(err)
	}
	if events[len(events)-1] != "[DONE]" {
		t.Fatalf("no [DONE]: %v", events)
	}
	roles, tokens, finished := map[int]int{}, map[int]int{}, map[int]string{}
	finishes := map[int]int{}
	var usage *usageJSON
	for _, ev := range events[:len(events)-1] {
		var c chunk
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatalf("chunk %s: %v", ev, err)
		}
		if c.Usage != nil {
			usage = c.Usage
		}
		for _, ch := range c.Choices {
			switch {
			case ch.Delta != nil && ch.Delta.Role != nil:
				roles[ch.Index]++
			case ch.Delta != nil && ch.Delta.Content != nil:
				tokens[ch.Index]++
			}
			if ch.FinishReason != nil {
				finished[ch.Index] = *ch.FinishReason
				finishes[ch.Index]++
				// As in vLLM, the finish reason rides on the last token's
				// chunk, never on a chunk of its own.
				if ch.Delta == nil || ch.Delta.Content == nil || tokens[ch.Index] != maxTokens {
					t.Errorf("choice %d: finish_reason on %s, want it on the chunk of token %d", ch.Index, ev, maxTokens)
				}
			}
		}
	}
	for i := range n {
		if roles[i] != 1 || tokens[i] != maxTokens || finished[i] != "length" || finishes[i] != 1 {
			t.Errorf("choice %d: %d role chunks, %d token chunks, finish %q (%d times)", i, roles[i], tokens[i], finished[i], finishes[i])
		}
	}
	if len(roles) != n || len(tokens) != n {
		t.Errorf("choices streamed: roles %v tokens %v", roles, tokens)
	}
	if usage == nil || usage.CompletionTokens != n*maxTokens || usage.PromptTokens != single.Usage.PromptTokens {
		t.Errorf("stream usage %+v, want %d completion tokens", usage, n*maxTokens)
	}
}
