package gateway

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/affinity"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/redisconn"
	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
)

// The plain request's hot path (docs/proxy.md, "Overhead benchmark"): a
// key without limits, one deployment without max_concurrency, a
// zero-latency upstream, and the handler wired as in a data plane (a
// Redis limiter and affinity store under a prefix of its own). Compare
// CPU ns/op and allocs/op across builds:
//
//	go test -run '^$' -bench BenchmarkPlainChat -benchmem ./dataplane/internal/gateway/

var benchAnswer = []byte(`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"` +
	strings.Repeat("x", 300) + `"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30}}`)

func benchZeroUpstream() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if strings.Contains(string(body), `"stream":true`) {
			w.Header().Set("Content-Type", "text/event-stream")
			f := w.(http.Flusher)
			for i := range 32 {
				fmt.Fprintf(w, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok%d \"},\"finish_reason\":null}]}\n\n", i)
				f.Flush()
			}
			fmt.Fprint(w, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":32,\"total_tokens\":42}}\n\ndata: [DONE]\n\n")
			f.Flush()
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(benchAnswer)))
		_, _ = w.Write(benchAnswer)
	})
}

func benchPlainEnv(b *testing.B) (*env, string) {
	b.Helper()
	var rb [6]byte
	_, _ = rand.Read(rb[:])
	prefix := "pb" + hex.EncodeToString(rb[:]) + ":"
	pipe, err := redispipe.New(redispipe.Options{Addr: redisAddr})
	require.NoError(b, err)
	b.Cleanup(func() { _ = pipe.Close() })
	lim, err := limits.New(limits.Config{Pipe: pipe, KeyPrefix: prefix,
		Seeds: func(_ context.Context, _ string, needs []limits.SeedNeed) ([]int64, error) {
			return make([]int64, len(needs)), nil
		}})
	require.NoError(b, err)
	require.NoError(b, lim.Bootstrap(context.Background(), "o1"))
	store, err := affinity.New(affinity.Config{Conn: &redisconn.Conn{Pipe: pipe}, KeyPrefix: prefix})
	require.NoError(b, err)
	up := httptest.NewServer(benchZeroUpstream())
	b.Cleanup(up.Close)
	e := newEnv(b, func(c *Config) { c.Limiter, c.Affinity = lim, store })
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("d1", "g", up.URL+"/v1", nil)
	e.apply()
	return e, tok
}

func benchPlain(b *testing.B, stream bool) {
	e, tok := benchPlainEnv(b)
	body := chatBody("g", "")
	if stream {
		body = chatBody("g", `"stream":true`)
	}
	c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true}}
	do := func() {
		req, _ := http.NewRequest(http.MethodPost, e.srv.URL+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+tok)
		resp, err := c.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("status %d", resp.StatusCode)
		}
	}
	for range 20 {
		do()
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		do()
	}
}

func BenchmarkPlainChat(b *testing.B)       { benchPlain(b, false) }
func BenchmarkPlainChatStream(b *testing.B) { benchPlain(b, true) }
