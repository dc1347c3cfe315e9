package gateway

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
)

// fakeEngine answers every request with serve, counting them.
type fakeEngine struct {
	srv *httptest.Server
	n   atomic.Int64
}

func newFakeEngine(t *testing.T, serve http.HandlerFunc) *fakeEngine {
	f := &fakeEngine{}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.n.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		serve(w, r)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeEngine) base() string { return f.srv.URL + "/v1" }

func engineStatus(status int, retryAfter, body string) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if retryAfter != "" {
			w.Header().Set("Retry-After", retryAfter)
		}
		w.WriteHeader(status)
		_, _ = io.WriteString(w, body)
	}
}

const okBody = `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}`

// stream sends chunks SSE events, waiting first before the first and
// between each, then [DONE] (unless cut).
func stream(first, every time.Duration, chunks int, cut bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		fl := w.(http.Flusher)
		fl.Flush()
		wait := first
		for i := range chunks {
			select {
			case <-time.After(wait):
			case <-r.Context().Done():
				return
			}
			wait = every
			fmt.Fprintf(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t%d\"}}]}\n\n", i)
			fl.Flush()
		}
		if cut {
			return
		}
		fmt.Fprint(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7}}\n\n")
		fmt.Fprint(w, "data: [DONE]\n\n")
		fl.Flush()
	}
}

// TestEngine429RetriedElsewhere: an engine 429 never reaches the client
// raw: the request goes to another deployment, the 429ing one is parked
// for its Retry-After and receives nothing meanwhile; the attempts are in
// the header and the usage event.
func TestEngine429RetriedElsewhere(t *testing.T) {
	limited := newFakeEngine(t, engineStatus(http.StatusTooManyRequests, "30", `{"code":429,"type":"x"}`))
	good := newFakeEngine(t, engineStatus(http.StatusOK, "", okBody))
	e := newEnv(t)
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("d-limited", "g", limited.base(), nil)
	e.deploy("d-good", "g", good.base(), nil)
	e.apply()
	for range 20 {
		resp := e.post(RouteChat, tok, chatBody("g", ""))
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
		ev := e.sink.byID(t, resp.Header.Get(oai.RequestIDHeader))
		require.Equal(t, resp.Header.Get(oai.HeaderAttempts), strconv.Itoa(int(ev.Attempts)))
		require.Contains(t, []int32{1, 2}, ev.Attempts)
		require.Equal(t, "d-good", ev.DeploymentId)
	}
	require.LessOrEqual(t, limited.n.Load(), int64(1), "the parked deployment received requests during its Retry-After")
	require.Equal(t, int64(20), good.n.Load())
}

// TestUpstreamErrorsTyped: when every deployment fails, the client gets
// Sluice's shape with the stable code and retry hints of the failure.
func TestUpstreamErrorsTyped(t *testing.T) {
	for _, tc := range []struct {
		name        string
		serve       http.HandlerFunc
		status      int
		typ, code   string
		retryAfter  string // Retry-After-Ms expected ("" none)
		shouldRetry string
	}{
		{"429", engineStatus(429, "2", `{"code":429,"type":"x"}`), 429, oai.TypeRateLimit, oai.CodeUpstreamRateLimited, "2000", "true"},
		{"429 retry-after capped", engineStatus(429, "100000", `{}`), 429, oai.TypeRateLimit, oai.CodeUpstreamRateLimited, "60000", "true"},
		{"queue full 503", engineStatus(503, "", `{"error":{"message":"The engine is currently busy and cannot accept new requests. Please try again later or on a different instance.","type":"Service Unavailable","code":503}}`),
			503, oai.TypeServiceUnavailable, oai.CodeUpstreamOverloaded, "1000", "true"},
		{"502", engineStatus(502, "", `bad gateway`), 502, oai.TypeUpstream, oai.CodeUpstreamError, "1000", "true"},
		{"504", engineStatus(504, "", ``), 504, oai.TypeTimeout, oai.CodeUpstreamTimeout, "1000", "true"},
		{"400", engineStatus(400, "", `{"error":{"message":"max_tokens is too large","param":"max_tokens"}}`), 400, oai.TypeInvalidRequest, oai.CodeUpstreamBadRequest, "", "false"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newFakeEngine(t, tc.serve)
			b := newFakeEngine(t, tc.serve)
			e := newEnv(t)
			tok := e.key("k1", nil)
			e.group("g")
			e.deploy("a", "g", a.base(), nil)
			e.deploy("b", "g", b.base(), nil)
			e.apply()
			r := readErr(t, e.post(RouteChat, tok, chatBody("g", "")))
			require.Equal(t, tc.status, r.Status, "%+v", r.Error)
			require.Equal(t, tc.typ, r.Error.Type)
			require.Equal(t, tc.code, r.Error.Code)
			require.Equal(t, tc.retryAfter, r.Header.Get("Retry-After-Ms"))
			require.Equal(t, tc.shouldRetry, r.Header.Get("X-Should-Retry"))
			if tc.code == oai.CodeUpstreamBadRequest {
				require.Contains(t, r.Error.Message, "max_tokens is too large")
				require.Equal(t, "1", r.Header.Get(oai.HeaderAttempts), "a 4xx is never retried")
			} else {
				require.Equal(t, "2", r.Header.Get(oai.HeaderAttempts), "retried on the other deployment")
				require.Equal(t, int64(1), a.n.Load())
				require.Equal(t, int64(1), b.n.Load())
			}
		})
	}
}

// TestQueueFullIsBackpressure: vLLM's admission-valve 503 routes
// elsewhere but never ejects the deployment; a plain 503 counts.
func TestQueueFullIsBackpressure(t *testing.T) {
	full := newFakeEngine(t, engineStatus(503, "", `{"error":{"message":"The engine has reached its prefill token backlog limit. Please try again later or on a different instance."}}`))
	e := newEnv(t, func(c *Config) { c.NoRetries = true })
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("full", "g", full.base(), nil)
	e.apply()
	for range 10 {
		r := readErr(t, e.post(RouteChat, tok, chatBody("g", "")))
		require.Equal(t, oai.CodeUpstreamOverloaded, r.Error.Code)
	}
	require.False(t, e.h.states.Get("full").Health.Ejected(time.Now()), "backpressure ejected the deployment")
}

// TestTTFTDeadline: a stream attempt that sent nothing by the TTFT
// deadline is abandoned and retried elsewhere; one that sent its first
// event runs on (never retried after bytes).
func TestTTFTDeadline(t *testing.T) {
	// Wide enough that the fast engine's first event (immediate) makes it
	// under -race on a loaded machine; the generating engine's stream
	// (10 ms, then 4 × 250 ms) still runs past it.
	const ttft = 500 * time.Millisecond
	slow := newFakeEngine(t, stream(5*time.Second, 0, 1, false))
	fast := newFakeEngine(t, stream(0, 10*time.Millisecond, 3, false))
	// Every request may pick the slow engine first: the retry budget's
	// floor (3 a window by default) must not be what this test measures.
	e := newEnv(t, func(c *Config) { c.TTFTTimeout, c.RetryBudgetMin = ttft, 100 })
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("slow", "g", slow.base(), nil)
	e.deploy("fast", "g", fast.base(), nil)
	e.apply()
	for range 6 {
		start := time.Now()
		resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
		data := sseData(t, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, "%v", data)
		require.Equal(t, "[DONE]", data[len(data)-1])
		require.Less(t, time.Since(start), ttft+time.Second)
	}
	require.Equal(t, int64(6), fast.n.Load())

	// Generating past the TTFT deadline (first event early, slow after):
	// never abandoned.
	gen := newFakeEngine(t, stream(10*time.Millisecond, 250*time.Millisecond, 4, false))
	e2 := newEnv(t, func(c *Config) { c.TTFTTimeout = ttft })
	tok2 := e2.key("k1", nil)
	e2.group("g")
	e2.deploy("gen", "g", gen.base(), nil)
	e2.apply()
	resp := e2.post(RouteChat, tok2, chatBody("g", `"stream":true`))
	data := sseData(t, resp.Body)
	resp.Body.Close()
	require.Equal(t, "[DONE]", data[len(data)-1])
	require.Equal(t, "1", resp.Header.Get(oai.HeaderAttempts))
}

// TestDeadlineWhileGenerating: an attempt that times out at the total
// deadline while generating ends with a typed error event and is never
// retried; the answer ends within the deadline + 50 ms.
func TestDeadlineWhileGenerating(t *testing.T) {
	const deadline = 400 * time.Millisecond
	gen := newFakeEngine(t, stream(10*time.Millisecond, 100*time.Millisecond, 100, false))
	other := newFakeEngine(t, stream(10*time.Millisecond, 100*time.Millisecond, 100, false))
	e := newEnv(t, func(c *Config) { c.RequestTimeout = deadline })
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("gen", "g", gen.base(), nil)
	e.deploy("other", "g", other.base(), nil)
	e.apply()
	start := time.Now()
	resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
	data := sseData(t, resp.Body)
	resp.Body.Close()
	took := time.Since(start)
	require.LessOrEqual(t, took, deadline+50*time.Millisecond)
	require.Contains(t, data[len(data)-1], oai.CodeUpstreamTimeout)
	require.Equal(t, "1", resp.Header.Get(oai.HeaderAttempts))
	require.Equal(t, int64(1), gen.n.Load()+other.n.Load(), "an attempt that was generating was retried")
	ev := e.sink.byID(t, resp.Header.Get(oai.RequestIDHeader))
	require.Equal(t, int32(1), ev.Attempts)
	require.Equal(t, oai.CodeUpstreamTimeout, ev.ErrorCode)
	t.Logf("deadline %s, answer ended after %s", deadline, took.Round(time.Millisecond))
}

// TestCutBeforeFirstEvent: a stream cut before its first event reached
// the client is retried elsewhere; one cut after is not.
func TestCutBeforeFirstEvent(t *testing.T) {
	cut0 := newFakeEngine(t, stream(0, 0, 0, true))
	good := newFakeEngine(t, stream(0, 0, 2, false))
	e := newEnv(t)
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("cut0", "g", cut0.base(), nil)
	e.deploy("good", "g", good.base(), nil)
	e.apply()
	for range 5 {
		resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
		data := sseData(t, resp.Body)
		resp.Body.Close()
		require.Equal(t, "[DONE]", data[len(data)-1])
	}

	cut2 := newFakeEngine(t, stream(0, 0, 2, true))
	good2 := newFakeEngine(t, stream(0, 0, 2, false))
	e2 := newEnv(t)
	tok2 := e2.key("k1", nil)
	e2.group("g")
	e2.deploy("cut2", "g", cut2.base(), nil)
	e2.deploy("good", "g", good2.base(), nil)
	e2.apply()
	cuts := 0
	for range 6 {
		resp := e2.post(RouteChat, tok2, chatBody("g", `"stream":true`))
		data := sseData(t, resp.Body)
		resp.Body.Close()
		require.Equal(t, "1", resp.Header.Get(oai.HeaderAttempts))
		if data[len(data)-1] != "[DONE]" {
			require.Contains(t, data[len(data)-1], oai.CodeUpstreamStreamError)
			cuts++
		}
	}
	require.Equal(t, int(cut2.n.Load()), cuts)
}

// TestRetryBudget: in a brownout (every deployment fails), retries add at
// most the budget's ratio of the pool's requests (plus its minimum); the
// rest get the original error. Refusals are counted.
func TestRetryBudgetBrownout(t *testing.T) {
	var engines []*fakeEngine
	e := newEnv(t, func(c *Config) { c.MaxRetries = 3 })
	tok := e.key("k1", nil)
	e.group("g")
	for i := range 4 {
		f := newFakeEngine(t, engineStatus(503, "", `{"error":{"message":"The engine is currently busy and cannot accept new requests."}}`))
		engines = append(engines, f)
		e.deploy(fmt.Sprintf("d%d", i), "g", f.base(), nil)
	}
	e.apply()
	const n = 100
	for range n {
		r := readErr(t, e.post(RouteChat, tok, chatBody("g", "")))
		require.Equal(t, oai.CodeUpstreamOverloaded, r.Error.Code)
		require.NotEmpty(t, r.Header.Get("Retry-After"))
	}
	var calls int64
	for _, f := range engines {
		calls += f.n.Load()
	}
	t.Logf("%d requests, %d upstream attempts (%.2f per request)", n, calls, float64(calls)/n)
	require.LessOrEqual(t, float64(calls), 1.2*n+3)
	require.Positive(t, counter(t, e.reg, "sluice_proxy_retry_budget_refusals_total", map[string]string{"model_group": "g"}))
}

// TestParkMaxAndEjectionPercent: a Retry-After parks at most ParkMax; with
// half the pool parked a third failing deployment is not taken out.
func TestParkMaxAndEjectionPercent(t *testing.T) {
	limited := newFakeEngine(t, engineStatus(http.StatusTooManyRequests, "100000", `{}`))
	e := newEnv(t, func(c *Config) { c.ParkMax = 5 * time.Second; c.NoRetries = true })
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("lim", "g", limited.base(), nil)
	e.apply()
	r := readErr(t, e.post(RouteChat, tok, chatBody("g", "")))
	require.Equal(t, "5000", r.Header.Get("Retry-After-Ms"))
	until := e.h.states.Get("lim").Health.EjectedUntil()
	require.WithinDuration(t, time.Now().Add(5*time.Second), until, time.Second)

	// Four deployments, 50%: two 429ing ones parked, the two others (one
	// of them parked too, by hand) both stay in rotation.
	good := newFakeEngine(t, engineStatus(http.StatusOK, "", okBody))
	e2 := newEnv(t, func(c *Config) { c.MaxEjectionPercent = 50 })
	tok2 := e2.key("k1", nil)
	e2.group("g")
	for _, id := range []string{"a", "b", "c", "d"} {
		e2.deploy(id, "g", good.base(), nil)
	}
	e2.apply()
	now := time.Now()
	for i, id := range []string{"a", "b", "c"} {
		e2.h.states.Get(id).Health.Park(now, time.Duration(10+i)*time.Second)
	}
	seen := map[string]bool{}
	for range 40 {
		resp := e2.post(RouteChat, tok2, chatBody("g", ""))
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		seen[e2.sink.byID(t, resp.Header.Get(oai.RequestIDHeader)).DeploymentId] = true
	}
	// At most 50% out: the parking ending first (a) is kept in rotation,
	// as a last resort behind the healthy d (TestCappedAreLastResort,
	// TestParkedOnlyWhenNothingElse: it serves when nothing else can).
	require.Equal(t, map[string]bool{"d": true}, seen, "a parked deployment kept in by the cap is a last resort")
	var g dto.Metric
	require.NoError(t, e2.h.m.poolOut.WithLabelValues("g").Write(&g))
	require.Equal(t, 0.5, g.GetGauge().GetValue(), "at most 50% out of rotation")
}
