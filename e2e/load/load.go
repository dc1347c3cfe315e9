// Package load drives the people-and-agents scenario against a Sluice
// proxy: multi-turn coding-agent loops and chat probes, over the OpenAI
// chat API with streaming. The scenario benchmark (make
// bench-humans-agents) and the `sluice dev` demo load (make dev-load)
// use it.
package load

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/sluicegw/sluice/e2e/vllmsim"
)

// Msg is a chat message.
type Msg struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Post sends a streamed chat completion of model with tok to the proxy at
// url (with an X-Session-Id when session is set); the caller reads and
// closes the answer.
func Post(ctx context.Context, url, tok, model, session string, msgs []Msg, maxTokens int) (*http.Response, error) {
	body, _ := json.Marshal(map[string]any{"model": model, "messages": msgs, "max_tokens": maxTokens, "stream": true,
		"stream_options": map[string]any{"include_usage": true}})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+tok)
	req.Header.Set("Content-Type", "application/json")
	if session != "" {
		req.Header.Set("X-Session-Id", session)
	}
	return http.DefaultClient.Do(req)
}

// ReadStream reads an OpenAI chat stream: the content, the arrival time of
// every chunk carrying content, and the final usage's completion tokens.
func ReadStream(r io.Reader) (content string, chunks []time.Time, completion int, err error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	var sb strings.Builder
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var ev struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Usage *struct {
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
			Error *json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			continue
		}
		if ev.Error != nil {
			return sb.String(), chunks, completion, fmt.Errorf("stream error %s", *ev.Error)
		}
		for _, c := range ev.Choices {
			if c.Delta.Content != "" {
				chunks = append(chunks, time.Now())
				sb.WriteString(c.Delta.Content)
			}
		}
		if ev.Usage != nil {
			completion = ev.Usage.CompletionTokens
		}
	}
	return sb.String(), chunks, completion, sc.Err()
}

// Agent is the shape of a coding-agent loop: a conversation of Prompt
// tokens growing each turn by the answer (at most Output tokens) and
// Growth tokens of tool output, started over (a new session) once it
// outgrows MaxPrompt.
type Agent struct {
	Model                             string
	Prompt, Growth, Output, MaxPrompt int
}

// Run runs the loop as agent name through the proxy at url with tok until
// ctx ends. Every stream's content-chunk arrival times and completion
// tokens go to streamed; refused or failed turns are counted in errs (and
// retried after 100 ms).
func (a Agent) Run(ctx context.Context, url, tok, name string, seed uint64, streamed func(chunks []time.Time, completion int), errs *atomic.Int64) {
	failed := func() {
		if ctx.Err() == nil {
			errs.Add(1)
			select {
			case <-time.After(100 * time.Millisecond):
			case <-ctx.Done():
			}
		}
	}
	for conv := 1; ctx.Err() == nil; conv++ {
		session := fmt.Sprintf("%s-c%d", name, conv)
		base := seed + uint64(conv)*1000
		msgs := []Msg{{Role: "system", Content: "You are coding agent " + session + ". " + vllmsim.FillerText(base, a.Prompt)}}
		prompt := a.Prompt
		for turn := 0; ctx.Err() == nil && prompt < a.MaxPrompt; turn++ {
			resp, err := Post(ctx, url, tok, a.Model, session, msgs, a.Output)
			if err != nil {
				failed()
				continue
			}
			if resp.StatusCode != http.StatusOK {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				failed()
				continue
			}
			content, chunks, n, err := ReadStream(resp.Body)
			resp.Body.Close()
			streamed(chunks, n)
			if err != nil {
				continue
			}
			msgs = append(msgs, Msg{Role: "assistant", Content: content},
				Msg{Role: "user", Content: "Tool output: " + vllmsim.FillerText(base+uint64(turn)+1, a.Growth)})
			prompt += n + a.Growth
		}
	}
}

// Chat sends one chat probe (a prompt of promptTokens, an answer of at
// most outputTokens, streamed) and returns its time to first token; ok is
// false when it was refused (status) or failed.
func Chat(url, tok, model string, seed uint64, promptTokens, outputTokens int) (ttft time.Duration, status int, ok bool) {
	msgs := []Msg{{Role: "user", Content: vllmsim.FillerText(seed, promptTokens)}}
	start := time.Now()
	resp, err := Post(context.Background(), url, tok, model, "", msgs, outputTokens)
	if err != nil {
		return 0, 0, false
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, resp.Body)
		return 0, resp.StatusCode, false
	}
	_, chunks, _, err := ReadStream(resp.Body)
	if err != nil || len(chunks) == 0 {
		return 0, resp.StatusCode, false
	}
	return chunks[0].Sub(start), resp.StatusCode, true
}
