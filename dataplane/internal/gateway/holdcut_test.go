package gateway

import (
	"fmt"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/forward"
	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
)

// emptyStream answers 200 SSE headers and closes without an event: a
// stream cut before its first event (nothing held, nothing relayed).
func emptyStream(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	w.(http.Flusher).Flush()
}

// sequencePool deploys n deployments of group g, each its own engine,
// all answering from one sequence of upstream calls: the i-th call to any
// of them (1-based) is served by serve(i). Which deployment a call goes
// to does not matter (the weighted shuffle is random), only the order of
// the calls, so the sequence of outcomes a request meets is fixed.
func sequencePool(t *testing.T, e *env, g string, n int, calls *atomic.Int64, serve func(i int64) http.HandlerFunc) {
	for i := range n {
		eng := newFakeEngine(t, func(w http.ResponseWriter, r *http.Request) { serve(calls.Add(1))(w, r) })
		e.deploy(fmt.Sprintf("d%d", i), g, eng.base(), nil)
	}
}

func (e *env) holdsAll(n int, reason, outcome string) float64 {
	var s float64
	for i := range n {
		s += e.holds(fmt.Sprintf("d%d", i), reason, outcome)
	}
	return s
}

// TestHoldCutGrace: the brownout's exhaustion case. A stream held on
// probation is cut within its hold (nothing reached the client), then a
// 503 and a 429 use the rest of the attempt budget (3: --max-retries 2)
// while a deployment that can serve remains untried. The held cut gives
// its attempt back (forward.Outcome.HoldCut, HoldCutGrace): the fourth
// attempt serves the stream ([DONE], x-sluice-attempts 4, attempts 4 in
// the usage event). The same sequence with the stream cut before its
// first event (not held: an ordinary retry) ends at 3 attempts with the
// 429, as before: only a cut the hold caught is given back.
func TestHoldCutGrace(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		first     http.HandlerFunc
		status    int
		attempts  int
		holdCuts  float64
		lastEvent string
	}{
		{"cut within the hold", stream(0, 5*time.Millisecond, 1, true), http.StatusOK, 4, 1, "[DONE]"},
		{"cut before the first event", emptyStream, http.StatusTooManyRequests, 3, 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var calls atomic.Int64
			e := newEnv(t, withProbation, func(c *Config) { c.MaxRetries = 2 })
			tok := e.key("k1", nil)
			e.group("g")
			sequencePool(t, e, "g", 4, &calls, func(i int64) http.HandlerFunc {
				switch i {
				case 1:
					return tc.first
				case 2:
					return engineStatus(http.StatusServiceUnavailable, "", `{"object":"error","message":"engine restarting"}`)
				case 3:
					return engineStatus(http.StatusTooManyRequests, "30", `{"object":"error","message":"rate limited"}`)
				}
				return stream(0, 0, 2, false)
			})
			e.apply()
			resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
			require.Equal(t, strconv.Itoa(tc.attempts), resp.Header.Get(oai.HeaderAttempts))
			require.Equal(t, int64(tc.attempts), calls.Load(), "upstream calls")
			if tc.status == http.StatusOK {
				require.Equal(t, http.StatusOK, resp.StatusCode)
				data := sseData(t, resp.Body)
				resp.Body.Close()
				require.Equal(t, tc.lastEvent, data[len(data)-1], "the stream did not end cleanly")
				ev := e.sink.events()
				require.Len(t, ev, 1)
				require.Equal(t, int32(tc.attempts), ev[0].GetAttempts())
			} else {
				ae := readErr(t, resp)
				require.Equal(t, tc.status, ae.Status)
				require.Equal(t, oai.CodeUpstreamRateLimited, ae.Error.Code)
			}
			require.Equal(t, tc.holdCuts, e.holdsAll(4, forward.HoldProbation, forward.HoldCut))
		})
	}
}

// TestHoldCutGraceBounded: a pool of stream-cutters only, all on
// probation: every attempt is cut within its hold. The grace is bounded:
// the request makes its 3 attempts (--max-retries 2) plus HoldCutGrace,
// though untried deployments remain, and ends with the typed 502
// upstream_error of its last cut (nothing reached the client).
func TestHoldCutGraceBounded(t *testing.T) {
	t.Parallel()
	const n = 8
	var calls atomic.Int64
	e := newEnv(t, withProbation, func(c *Config) { c.MaxRetries = 2 })
	tok := e.key("k1", nil)
	e.group("g")
	sequencePool(t, e, "g", n, &calls, func(int64) http.HandlerFunc { return stream(0, 5*time.Millisecond, 1, true) })
	e.apply()
	resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
	ae := readErr(t, resp)
	want := 3 + HoldCutGrace
	require.Equal(t, http.StatusBadGateway, ae.Status)
	require.Equal(t, oai.CodeUpstreamError, ae.Error.Code)
	require.Equal(t, strconv.Itoa(want), ae.Header.Get(oai.HeaderAttempts))
	require.Equal(t, int64(want), calls.Load(), "upstream calls beyond the attempt budget and its grace")
	require.Equal(t, float64(want), e.holdsAll(n, forward.HoldProbation, forward.HoldCut))
}

// TestLastAttemptPrefersProven: six deployments answering 429 (no
// Retry-After: never parked, never failing, never proven) and one that
// streams cleanly; two attempts per request (--max-retries 1). Once the
// clean one is proven by a stream, the last attempt of every request
// goes to it (preferProven): all 30 requests are served, whatever their
// first attempt met. Without the preference the last attempt would be a
// weighted pick among the six others too (5 in 7 requests refused).
func TestLastAttemptPrefersProven(t *testing.T) {
	t.Parallel()
	good := newFakeEngine(t, stream(0, 0, 2, false))
	e := newEnv(t, withProbation, func(c *Config) { c.MaxRetries, c.RetryBudgetMin = 1, 1000 })
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("good", "g", good.base(), nil)
	for i := range 6 {
		busy := newFakeEngine(t, engineStatus(http.StatusTooManyRequests, "", `{"object":"error","message":"busy"}`))
		e.deploy(fmt.Sprintf("busy%d", i), "g", busy.base(), nil)
	}
	e.apply()
	proven := &e.h.states.Get("good").Health.Probation
	for i := 0; !proven.Proven(); i++ {
		require.Less(t, i, 200, "the clean deployment was never proven")
		resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
		_ = sseData(t, resp.Body)
		resp.Body.Close()
	}
	before := good.n.Load()
	for range 30 {
		resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
		require.Equal(t, http.StatusOK, resp.StatusCode, "the last attempt did not go to the proven deployment")
		data := sseData(t, resp.Body)
		resp.Body.Close()
		require.Equal(t, "[DONE]", data[len(data)-1])
	}
	require.Equal(t, int64(30), good.n.Load()-before, "every request served by the proven deployment")
}

// TestHoldCutRetryAllowance: a held cut's retry takes the held cuts' own
// allowance (the retry budget's minimum a window) before the retry
// budget, so the probation's cuts do not spend the retries the rest of a
// brownout needs; other retries take the retry budget as before, and the
// allowance is bounded. --retry-budget-min 2: a stream cut twice within
// its holds is retried twice on the allowance and served; a
// non-streaming request's two 503s are then retried on the untouched
// retry budget and served; a third 503 is refused with pushback. With a
// minimum of 1 and the budget spent, the second held cut's retry finds
// the allowance spent too: a typed 502, x-should-retry false.
func TestHoldCutRetryAllowance(t *testing.T) {
	t.Parallel()
	unavailable := engineStatus(http.StatusServiceUnavailable, "", `{"object":"error","message":"engine restarting"}`)
	held := stream(0, 5*time.Millisecond, 1, true)
	t.Run("served", func(t *testing.T) {
		t.Parallel()
		var calls atomic.Int64
		e := newEnv(t, withProbation, func(c *Config) { c.MaxRetries, c.RetryBudgetMin = 2, 2 })
		tok := e.key("k1", nil)
		e.group("g")
		sequencePool(t, e, "g", 6, &calls, func(i int64) http.HandlerFunc {
			switch i {
			case 1, 2:
				return held
			case 3:
				return stream(0, 0, 2, false)
			case 6:
				return engineStatus(http.StatusOK, "", okBody)
			}
			return unavailable
		})
		e.apply()
		resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
		require.Equal(t, http.StatusOK, resp.StatusCode)
		data := sseData(t, resp.Body)
		resp.Body.Close()
		require.Equal(t, "[DONE]", data[len(data)-1])
		require.Equal(t, "3", resp.Header.Get(oai.HeaderAttempts))
		require.Equal(t, 2.0, counterValue(e.h.m.holdCutRetries.WithLabelValues("g")))
		// The retry budget is untouched: a non-stream's two 503s are
		// retried on it.
		resp = e.post(RouteChat, tok, chatBody("g", ""))
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, "3", resp.Header.Get(oai.HeaderAttempts))
		resp.Body.Close()
		require.Equal(t, int64(6), calls.Load())
		require.Zero(t, counterValue(e.h.m.retryRefusals.WithLabelValues("g")))
		// Spent now: a 503's retry is refused, the original error with
		// pushback.
		ae := readErr(t, e.post(RouteChat, tok, chatBody("g", "")))
		require.Equal(t, http.StatusServiceUnavailable, ae.Status)
		require.Equal(t, "1", ae.Header.Get(oai.HeaderAttempts))
		require.Equal(t, "false", ae.Header.Get("X-Should-Retry"))
		require.Equal(t, 1.0, counterValue(e.h.m.retryRefusals.WithLabelValues("g")))
	})
	t.Run("allowance spent", func(t *testing.T) {
		t.Parallel()
		var calls atomic.Int64
		e := newEnv(t, withProbation, func(c *Config) { c.MaxRetries, c.RetryBudgetMin = 2, 1 })
		tok := e.key("k1", nil)
		e.group("g")
		sequencePool(t, e, "g", 6, &calls, func(i int64) http.HandlerFunc {
			switch i {
			case 1:
				return unavailable
			case 2:
				return engineStatus(http.StatusOK, "", okBody)
			}
			return held
		})
		e.apply()
		resp := e.post(RouteChat, tok, chatBody("g", ""))
		require.Equal(t, http.StatusOK, resp.StatusCode)
		resp.Body.Close()
		ae := readErr(t, e.post(RouteChat, tok, chatBody("g", `"stream":true`)))
		require.Equal(t, http.StatusBadGateway, ae.Status)
		require.Equal(t, oai.CodeUpstreamError, ae.Error.Code)
		require.Equal(t, "2", ae.Header.Get(oai.HeaderAttempts))
		require.Equal(t, "false", ae.Header.Get("X-Should-Retry"))
		require.Equal(t, int64(4), calls.Load())
		require.Equal(t, 1.0, counterValue(e.h.m.holdCutRetries.WithLabelValues("g")))
	})
}
