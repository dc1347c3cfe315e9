package vllmsim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestMain fails the run if a test leaves goroutines of this package
// behind (a hand-rolled goleak: the module takes no third-party test deps).
func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if leaked := waitForLeaks(5 * time.Second); leaked != "" {
			fmt.Fprintf(os.Stderr, "goroutines leaked:\n%s\n", leaked)
			code = 1
		}
	}
	os.Exit(code)
}

func waitForLeaks(timeout time.Duration) string {
	deadline := time.Now().Add(timeout)
	for {
		leaked := leakedGoroutines()
		if leaked == "" || time.Now().After(deadline) {
			return leaked
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func leakedGoroutines() string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var leaked []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "vllmsim.TestMain") || strings.Contains(g, "vllmsim.waitForLeaks") {
			continue
		}
		if strings.Contains(g, "e2e/vllmsim.") {
			leaked = append(leaked, g)
		}
	}
	return strings.Join(leaked, "\n\n")
}

func jsonString(s string) json.RawMessage {
	b, err := json.Marshal(s)
	if err != nil {
		panic(err)
	}
	return b
}

// tWriter sends log lines to the test log while the test runs.
type tWriter struct {
	mu   sync.Mutex
	t    testing.TB
	done bool
}

func (w *tWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(strings.TrimSpace(string(p)))
	}
	return len(p), nil
}

func testLogger(tb testing.TB) *slog.Logger {
	w := &tWriter{t: tb}
	tb.Cleanup(func() {
		w.mu.Lock()
		w.done = true
		w.mu.Unlock()
	})
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// simConfig is the default configuration on a free local port, 100 times
// faster than real time.
func simConfig(mod func(*Config)) Config {
	cfg := DefaultConfig()
	cfg.Addr = "127.0.0.1:0"
	cfg.TimeScale = 100
	cfg.Seed = 1
	if mod != nil {
		mod(&cfg)
	}
	return cfg
}

// sim is a running simulator and an HTTP client for it.
type sim struct {
	*Server
	t      testing.TB
	client *http.Client
}

func startSim(tb testing.TB, mod func(*Config)) *sim {
	tb.Helper()
	s, err := Start(simConfig(mod), testLogger(tb))
	if err != nil {
		tb.Fatalf("Start: %v", err)
	}
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	tb.Cleanup(func() {
		tr.CloseIdleConnections()
		if err := s.Close(); err != nil {
			tb.Errorf("Close: %v", err)
		}
	})
	return &sim{Server: s, t: tb, client: &http.Client{Transport: tr}}
}

// post sends a JSON body (headers as "Name: value" pairs) and returns the
// response; the caller closes its body.
func (s *sim) post(ctx context.Context, path string, body any, headers ...string) (*http.Response, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.URL()+path, bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	for _, h := range headers {
		k, v, _ := strings.Cut(h, ":")
		req.Header.Set(strings.TrimSpace(k), strings.TrimSpace(v))
	}
	return s.client.Do(req)
}

// do posts and decodes a JSON answer, failing the test unless the status
// is want.
func (s *sim) do(path string, body any, want int, out any, headers ...string) http.Header {
	s.t.Helper()
	resp, err := s.post(context.Background(), path, body, headers...)
	if err != nil {
		s.t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		s.t.Fatalf("read %s: %v", path, err)
	}
	if resp.StatusCode != want {
		s.t.Fatalf("POST %s: status %d, want %d: %s", path, resp.StatusCode, want, raw)
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			s.t.Fatalf("decode %s answer %s: %v", path, raw, err)
		}
	}
	return resp.Header
}

func (s *sim) get(path string) (int, string) {
	s.t.Helper()
	resp, err := s.client.Get(s.URL() + path)
	if err != nil {
		s.t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		s.t.Fatalf("read %s: %v", path, err)
	}
	return resp.StatusCode, string(raw)
}

// sseEvents reads a stream's data payloads until EOF; err is the read
// error that ended it, if any.
func sseEvents(r io.Reader) (events []string, err error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if d, ok := strings.CutPrefix(line, "data: "); ok {
			events = append(events, d)
		} else if line != "" {
			return events, fmt.Errorf("unexpected SSE line %q", line)
		}
	}
	return events, sc.Err()
}

// chunk is the subset of a chat or completion chunk the tests look at.
type chunk struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index int `json:"index"`
		Delta *struct {
			Role    *string `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
		Text         *string `json:"text"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *usageJSON `json:"usage"`
}

type usageJSON struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (u usageJSON) cached() int {
	if u.PromptTokensDetails == nil {
		return 0
	}
	return u.PromptTokensDetails.CachedTokens
}

type chatResponse struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index   int `json:"index"`
		Message struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Text         string `json:"text"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	Usage usageJSON `json:"usage"`
}

type errorResponse struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    int     `json:"code"`
	} `json:"error"`
}

func chatBody(content string, extra map[string]any) map[string]any {
	b := map[string]any{"model": DefaultModel, "messages": []map[string]any{{"role": "user", "content": content}}}
	for k, v := range extra {
		b[k] = v
	}
	return b
}
