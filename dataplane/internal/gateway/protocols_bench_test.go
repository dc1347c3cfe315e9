package gateway

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// The protocol-overhead benchmark (issue 16, "Overhead on /v1/messages
// within 5 % of chat completions"): the same exchange as
// BenchmarkProxyOverhead (e2e/system) — the lighthouse prompt, its
// 38-token answer, or a 32-delta stream — sent to the gateway's handler
// in-process (no client socket) over Chat Completions and over Anthropic
// Messages, against a zero-latency upstream whose two answers are the
// same text and token counts. Every figure is the handler's own work:
// ns/op and allocs/op per protocol, and BenchmarkProtocolPaired
// alternates the two protocols request by request in one loop so that a
// shared machine's load falls on both alike (its p50s are comparable
// within one run).

const (
	pbChatBody = `{"model":"bench","messages":[{"role":"system","content":"You are a helpful assistant."},` +
		`{"role":"user","content":"Summarise the plot of a short novel about a lighthouse keeper in two sentences."}],` +
		`"max_tokens":128,"temperature":0.7}`
	pbMessagesBody = `{"model":"bench","system":"You are a helpful assistant.","messages":[` +
		`{"role":"user","content":"Summarise the plot of a short novel about a lighthouse keeper in two sentences."}],` +
		`"max_tokens":128,"temperature":0.7}`
	pbAnswer     = `A lighthouse keeper guards a remote coast and slowly learns that the light matters less than the people it brings home. In the end he leaves the tower to one of them.`
	pbCompletion = `{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench-upstream",` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"` + pbAnswer + `"},"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":42,"completion_tokens":38,"total_tokens":80}}`
	pbMessage = `{"id":"msg_bench","type":"message","role":"assistant","model":"bench-upstream",` +
		`"content":[{"type":"text","text":"` + pbAnswer + `"}],"stop_reason":"end_turn","stop_sequence":null,` +
		`"usage":{"input_tokens":42,"output_tokens":38}}`
	pbChunks = 32
)

// pbStreams are the two protocols' streams, built once.
var pbChatStream, pbMessagesStream = func() (string, string) {
	var c, m strings.Builder
	m.WriteString("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_bench\",\"type\":\"message\",\"role\":\"assistant\"," +
		"\"model\":\"m\",\"content\":[],\"stop_reason\":null,\"usage\":{\"input_tokens\":42,\"output_tokens\":1}}}\n\n" +
		"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n")
	for i := range pbChunks {
		fmt.Fprintf(&c, `data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"tok%d "},"finish_reason":null}]}`+"\n\n", i)
		fmt.Fprintf(&m, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"tok%d \"}}\n\n", i)
	}
	fmt.Fprintf(&c, `data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[],"usage":{"prompt_tokens":42,"completion_tokens":%d,"total_tokens":%d}}`+"\n\ndata: [DONE]\n\n",
		pbChunks, 42+pbChunks)
	fmt.Fprintf(&m, "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n"+
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":%d}}\n\n"+
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n", pbChunks)
	return c.String(), m.String()
}()

// pbUpstream answers both protocols at once, flushing a stream once per
// event as an engine does.
func pbUpstream() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		stream := strings.Contains(string(body), `"stream":true`)
		messages := strings.HasSuffix(r.URL.Path, "/messages")
		ans := pbCompletion
		if messages {
			ans = pbMessage
		}
		if !stream {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Content-Length", strconv.Itoa(len(ans)))
			_, _ = io.WriteString(w, ans)
			return
		}
		ans = pbChatStream
		if messages {
			ans = pbMessagesStream
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		for ev := range strings.SplitAfterSeq(ans, "\n\n") {
			if ev != "" {
				_, _ = io.WriteString(w, ev)
				fl.Flush()
			}
		}
	})
}

// discardSink drops usage events (a recording sink would grow with b.N).
type discardSink struct{}

func (discardSink) Record(*usagev1.UsageEvent) {}

// pbCase is one protocol's request.
type pbCase struct {
	name, route, body string
	stream            bool
}

var pbCases = []pbCase{
	{"chat", oai.RouteChat, pbChatBody, false},
	{"messages", RouteMessages, pbMessagesBody, false},
	{"chat_stream", oai.RouteChat, strings.Replace(pbChatBody, `"max_tokens":128`, `"max_tokens":128,"stream":true`, 1), true},
	{"messages_stream", RouteMessages, strings.Replace(pbMessagesBody, `"max_tokens":128`, `"max_tokens":128,"stream":true`, 1), true},
}

// pbEnv is a gateway with one key and a group "bench" whose deployment
// serves both protocols from pbUpstream.
func pbEnv(b *testing.B) (http.Handler, string) {
	up := httptest.NewServer(pbUpstream())
	b.Cleanup(up.Close)
	e := newEnv(b, func(c *Config) { c.Usage = discardSink{} })
	tok := e.key("k1", nil)
	e.group("bench")
	e.deploy("d1", "bench", up.URL+"/v1", func(d *configv1.Deployment) {
		d.UpstreamModel = "bench-upstream"
		d.Capabilities = &configv1.Capabilities{Protocols: []string{"anthropic_messages"}}
	})
	e.apply()
	mux := http.NewServeMux()
	e.h.Register(mux)
	return mux, tok
}

// pbDo serves one request in-process and checks its answer.
func pbDo(b *testing.B, h http.Handler, tok string, c pbCase) {
	req := httptest.NewRequest(http.MethodPost, c.route, strings.NewReader(c.body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+tok)
	if c.route == RouteMessages {
		req.Header.Set("Anthropic-Version", "2023-06-01")
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	if w.Code != http.StatusOK {
		b.Fatalf("%s: status %d: %s", c.name, w.Code, w.Body.String())
	}
	if c.stream && !strings.Contains(w.Body.String(), "tok31 ") {
		b.Fatalf("%s: stream cut: %s", c.name, w.Body.String())
	}
}

// BenchmarkProtocolOverhead: ns/op and allocs/op of one exchange per
// protocol, streamed and not.
func BenchmarkProtocolOverhead(b *testing.B) {
	h, tok := pbEnv(b)
	for _, c := range pbCases {
		b.Run(c.name, func(b *testing.B) {
			for range 50 {
				pbDo(b, h, tok, c)
			}
			b.ReportAllocs()
			for b.Loop() {
				pbDo(b, h, tok, c)
			}
		})
	}
}

// BenchmarkProtocolPaired alternates chat and Messages request by request
// (non-streamed, then streamed) and reports each protocol's p50 latency
// and their ratio: the two are measured under the same load.
func BenchmarkProtocolPaired(b *testing.B) {
	h, tok := pbEnv(b)
	for _, pair := range [][2]pbCase{{pbCases[0], pbCases[1]}, {pbCases[2], pbCases[3]}} {
		b.Run(pair[0].name, func(b *testing.B) {
			for range 50 {
				pbDo(b, h, tok, pair[0])
				pbDo(b, h, tok, pair[1])
			}
			var lat [2][]time.Duration
			i := 0
			for b.Loop() {
				c := i & 1
				if i>>1&1 == 1 { // ABBA order: neither goes first always
					c ^= 1
				}
				t0 := time.Now()
				pbDo(b, h, tok, pair[c])
				lat[c] = append(lat[c], time.Since(t0))
				i++
			}
			if len(lat[0]) == 0 || len(lat[1]) == 0 {
				return
			}
			p50 := func(l []time.Duration) float64 {
				slices.Sort(l)
				return float64(l[len(l)/2])
			}
			chat, msg := p50(lat[0]), p50(lat[1])
			b.ReportMetric(chat/1e3, "chat_p50_us")
			b.ReportMetric(msg/1e3, "messages_p50_us")
			b.ReportMetric(msg/chat, "messages/chat_p50")
		})
	}
}
