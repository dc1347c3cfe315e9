package gateway

import (
	"bufio"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/forward"
	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/upstream"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TestProbeHoldBounded: a half-open deployment's probe is held back at
// most forward.ProbeHoldMax: a long stream reaches its client after the
// hold, before its end; a cut after the hold reaches the client as a
// typed error event (never retried: bytes were out) and ejects the
// deployment again at once. The TTFT deadline (1 s, shorter than the
// hold) counts the first event held: the probe is not abandoned.
func TestProbeHoldBounded(t *testing.T) {
	t.Parallel()
	// 20 chunks 150 ms apart (3 s), then cut.
	long := newFakeEngine(t, stream(0, 150*time.Millisecond, 20, true))
	e := newEnv(t, func(c *Config) {
		c.EjectionBase, c.EjectionMax, c.TTFTTimeout = 100*time.Millisecond, time.Minute, time.Second
	})
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("long", "g", long.base(), nil)
	e.apply()
	h := &e.h.states.Get("long").Health
	for range 3 {
		h.FailedBackoff(time.Now(), 100*time.Millisecond, time.Minute)
	}
	waitFor(t, "the end of the ejection", func() bool { return h.HalfOpen(time.Now()) })

	start := time.Now()
	resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	sc := bufio.NewScanner(resp.Body)
	var data []string
	var firstAt time.Duration
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			if data == nil {
				firstAt = time.Since(start)
			}
			data = append(data, v)
		}
	}
	end := time.Since(start)
	t.Logf("probe: first event after %s (hold %s), stream ended after %s", firstAt.Round(time.Millisecond), forward.ProbeHoldMax, end.Round(time.Millisecond))
	require.GreaterOrEqual(t, firstAt, forward.ProbeHoldMax, "held back for the hold")
	require.Less(t, firstAt, end-500*time.Millisecond, "relayed before the stream ended")
	require.Len(t, data, 21, "the 20 chunks held and relayed, then the error event")
	require.Contains(t, data[20], oai.CodeUpstreamStreamError)
	require.Equal(t, "1", resp.Header.Get(oai.HeaderAttempts), "never retried after bytes")
	require.Equal(t, int64(1), long.n.Load())
	require.Equal(t, 1.0, e.attemptCount("long", "probe", "failed"))
	require.True(t, h.Ejected(time.Now()), "the failed probe ejects it again")
}

// cutOnRelease streams one chunk, then holds the stream open until a
// value on release (or its close) cuts it (no [DONE]).
func cutOnRelease(release <-chan struct{}) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		fmt.Fprint(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t\"}}]}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}
}

// TestCutWithOthersInFlightEjects: a stream cut after bytes reached the
// client ejects its deployment at once when other streams of the proxy
// are on it (they are likely cut too, and nothing new should start
// there); a lone cut counts as one failure of three. The cuts of the
// streams already on it do not extend the ejection.
func TestCutWithOthersInFlightEjects(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	cutter := newFakeEngine(t, cutOnRelease(release))
	e := newEnv(t, func(c *Config) { c.EjectionBase, c.EjectionMax = 10*time.Second, time.Minute })
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("c", "g", cutter.base(), nil)
	e.apply()
	h := &e.h.states.Get("c").Health
	inFlight := func() float64 {
		var m dto.Metric
		require.NoError(t, e.h.series.upstreamInFlight("c").Write(&m))
		return m.GetGauge().GetValue()
	}
	// streams starts n streams; each reports its last data line.
	streams := func(n int) <-chan string {
		out := make(chan string, n)
		for range n {
			go func() {
				resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
				data := sseData(t, resp.Body)
				resp.Body.Close()
				out <- data[len(data)-1]
			}()
		}
		return out
	}

	// A lone cut: one failure, not ejected.
	one := streams(1)
	waitFor(t, "the stream on the cutter", func() bool { return inFlight() == 1 })
	release <- struct{}{}
	require.Contains(t, <-one, oai.CodeUpstreamStreamError)
	require.False(t, h.Ejected(time.Now()), "a lone cut ejected the deployment")

	// Three streams on it; one is cut: ejected at once.
	three := streams(3)
	waitFor(t, "three streams on the cutter", func() bool { return inFlight() == 3 })
	release <- struct{}{}
	require.Contains(t, <-three, oai.CodeUpstreamStreamError)
	require.True(t, h.Ejected(time.Now()), "a cut with other streams in flight did not eject the deployment")
	until := h.EjectedUntil()
	require.WithinDuration(t, time.Now().Add(10*time.Second), until, 2*time.Second)
	// The two others are cut too (bytes were out: error events), without
	// extending the ejection.
	close(release)
	for range 2 {
		require.Contains(t, <-three, oai.CodeUpstreamStreamError)
	}
	require.Equal(t, until, h.EjectedUntil(), "the cuts of streams from before the ejection extended it")
	require.Equal(t, int64(4), cutter.n.Load(), "a cut stream was retried")
	require.Equal(t, 1.0, counter(t, e.reg, "sluice_proxy_deployment_ejections_total", map[string]string{"deployment": "c", "reason": "failures"}))
}

// TestRetryBudgetColdStart: a proxy that just started has no request
// history, so its retry budget is its minimum until the ratio of its
// requests catches up. Finding out a brownout costs a retry per faulty
// deployment (here five 429ing ones, each parked by its first 429, ahead
// of a healthy one by weight), all in its first requests: the default
// minimum (10 a window) covers them, where the former 3 refused a client.
// (A concurrent burst finds a faulty deployment once per request in
// flight before its first failure: docs/resilience.md, cold start.)
func TestRetryBudgetColdStart(t *testing.T) {
	t.Parallel()
	run := func(minRetries int) (refused int, retries int64) {
		good := newFakeEngine(t, engineStatus(http.StatusOK, "", okBody))
		e := newEnv(t, func(c *Config) { c.MaxRetries, c.RetryBudgetMin = 5, minRetries })
		tok := e.key("k1", nil)
		e.group("g")
		var limited []*fakeEngine
		for i := range 5 {
			f := newFakeEngine(t, engineStatus(http.StatusTooManyRequests, "30", `{"code":429}`))
			limited = append(limited, f)
			e.deploy(fmt.Sprintf("lim%d", i), "g", f.base(), func(d *configv1.Deployment) { d.Weight = 1000 })
		}
		e.deploy("good", "g", good.base(), nil)
		e.apply()
		for range 20 {
			resp := e.post(RouteChat, tok, chatBody("g", ""))
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				refused++
			}
		}
		for _, f := range limited {
			retries += f.n.Load()
		}
		return refused, retries
	}
	refused, retries := run(0) // the default
	require.Zero(t, refused, "a cold proxy refused clients while a healthy deployment could serve them")
	require.LessOrEqual(t, retries, int64(10))
	old, _ := run(3)
	t.Logf("cold start: default minimum %d: 0 refused (%d retries); minimum 3: %d refused", upstream.DefaultRetryBudgetMin, retries, old)
	require.Positive(t, old, "the former minimum did not refuse: the test shows nothing")
}

// TestDeadlineAcrossRetriesAndFallback: the total deadline (500 ms)
// holds within 50 ms across TTFT retries and a fallback group: every
// engine stalls; a stream makes two attempts abandoned at the primary
// group's TTFT deadline (150 ms) and a third on the fallback group, cut
// by the total deadline; a non-stream (no TTFT deadline) one attempt.
// Both end with a typed 504.
func TestDeadlineAcrossRetriesAndFallback(t *testing.T) {
	t.Parallel()
	const deadline = 500 * time.Millisecond
	e := newEnv(t, manyRetries, func(c *Config) { c.RequestTimeout = deadline })
	e.snap.ModelGroups = append(e.snap.ModelGroups,
		&configv1.ModelGroup{PlatformWide: true, Name: "p", Fallbacks: []string{"f"},
			Resilience: &configv1.ModelGroupResilience{TtftTimeoutMs: 150, MaxAttempts: 4}},
		&configv1.ModelGroup{PlatformWide: true, Name: "f"})
	for _, id := range []string{"p1", "p2"} {
		e.deploy(id, "p", newFakeEngine(t, stream(5*time.Second, 0, 1, false)).base(), nil)
	}
	e.deploy("f1", "f", newFakeEngine(t, stream(5*time.Second, 0, 1, false)).base(), nil)
	tok := e.key("k1", nil)
	e.apply()
	for _, tc := range []struct {
		body, attempts, group string
	}{
		{chatBody("p", `"stream":true`), "3", "f"},
		{chatBody("p", ""), "1", "p"},
	} {
		start := time.Now()
		r := readErr(t, e.post(RouteChat, tok, tc.body))
		took := time.Since(start)
		t.Logf("%s attempts, deadline %s: answered after %s", tc.attempts, deadline, took.Round(time.Millisecond))
		require.Equal(t, http.StatusGatewayTimeout, r.Status)
		require.Equal(t, oai.CodeUpstreamTimeout, r.Error.Code)
		require.Equal(t, tc.attempts, r.Header.Get(oai.HeaderAttempts))
		require.Equal(t, tc.group, r.Header.Get(oai.HeaderModelGroup))
		require.GreaterOrEqual(t, took, deadline)
		require.LessOrEqual(t, took, deadline+50*time.Millisecond, "the total deadline across retries and fallbacks")
	}
}

// TestPushbackWhenEveryAttemptFailed: a request whose every attempt
// failed once its pool's retries pass max(ratio × requests,
// upstream.PushbackMin) is answered with x-should-retry: false, though the
// budget's minimum (10) still lets the proxy retry: SDKs do not multiply
// the cold-start allowance; a request within it keeps x-should-retry:
// true (TestUpstreamErrorsTyped).
func TestPushbackWhenEveryAttemptFailed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.MaxRetries = 3 })
	tok := e.key("k1", nil)
	e.group("four")
	e.group("one")
	full := newFakeEngine(t, engineStatus(http.StatusServiceUnavailable, "", `{"error":{"message":"The engine is currently busy and cannot accept new requests."}}`))
	for i := range 4 {
		e.deploy(fmt.Sprintf("f%d", i), "four", full.base(), nil)
	}
	e.deploy("o", "one", full.base(), nil)
	e.apply()
	r := readErr(t, e.post(RouteChat, tok, chatBody("one", "")))
	require.Equal(t, "1", r.Header.Get(oai.HeaderAttempts))
	require.Equal(t, "true", r.Header.Get("X-Should-Retry"), "within the budget")
	r = readErr(t, e.post(RouteChat, tok, chatBody("four", "")))
	require.Equal(t, http.StatusServiceUnavailable, r.Status)
	require.Equal(t, "4", r.Header.Get(oai.HeaderAttempts), "within the budget's minimum")
	require.Equal(t, "false", r.Header.Get("X-Should-Retry"), "3 retries, past what clients may add to: pushback")
	r = readErr(t, e.post(RouteChat, tok, chatBody("four", "")))
	require.Equal(t, "4", r.Header.Get(oai.HeaderAttempts), "the proxy still retries on its minimum")
	require.Equal(t, "false", r.Header.Get("X-Should-Retry"))
}
