package gateway

import (
	"net/http"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// attemptCount reads sluice_proxy_upstream_attempts_total of one
// deployment, standing and outcome.
func (e *env) attemptCount(id, state, outcome string) float64 {
	return counterValue(e.h.m.attempts.WithLabelValues(id, state, outcome))
}

// attemptsAt sums sluice_proxy_upstream_attempts_total of one deployment.
func (e *env) attemptsAt(id string) float64 {
	var n float64
	for _, s := range []string{"healthy", "probe", "panic", "ejected", "probing", "health_check", "parked"} {
		for _, o := range []string{"ok", "retryable", "failed", "client_closed"} {
			n += e.attemptCount(id, s, o)
		}
	}
	return n
}

// TestCappedAreLastResort (vLLM simulators with fault injection): four
// deployments, one 429ing with Retry-After 30 s, one refusing
// connections (ejected for 10 s), one answering vLLM's queue-full 503
// with Retry-After 20 s, one healthy. Three are out, the maximum ejection
// percentage (50) keeps the one back first (the ejected one) in
// rotation: as a last resort. Every request goes to the healthy one on
// its first attempt; the 429ing engine receives nothing while parked;
// the kept-in one serves only a retry the healthy one could not.
func TestCappedAreLastResort(t *testing.T) {
	t.Parallel()
	limited := startSim(t, func(c *vllmsim.Config) {
		c.Faults.Status, c.Faults.RetryAfter = http.StatusTooManyRequests, 30*time.Second
	})
	refusing := startSim(t, nil)
	require.NoError(t, refusing.SetRefuseConnections(true))
	full := startSim(t, func(c *vllmsim.Config) {
		c.Faults.Status, c.Faults.RetryAfter = http.StatusServiceUnavailable, 20*time.Second
	})
	good := startSim(t, nil)
	e := newEnv(t, manyRetries, func(c *Config) {
		c.MaxRetries, c.MaxEjectionPercent = 3, 50
		c.EjectionBase, c.EjectionMax = 10*time.Second, time.Minute
	})
	tok := e.key("k1", nil)
	e.group("g")
	for id, s := range map[string]*vllmsim.Server{"limited": limited, "refusing": refusing, "full": full, "good": good} {
		e.deploy(id, "g", s.URL()+"/v1", nil)
	}
	e.apply()
	// Until all three faulty ones are out (each failure is retried: the
	// clients get their answers).
	out := func(id string) bool { return e.h.states.Get(id).Health.Ejected(time.Now()) }
	for i := 0; !(out("limited") && out("refusing") && out("full")); i++ {
		require.Less(t, i, 200, "the faulty deployments were never all out")
		resp := e.post(RouteChat, tok, chatBody("g", ""))
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	reason, _, _ := e.h.states.Get("refusing").Health.Out(time.Now())
	require.Equal(t, "ejected", reason)
	limitedBefore := e.attemptsAt("limited")
	require.Equal(t, 1.0, limitedBefore, "parked after its first 429")
	fullBefore, refusingBefore := e.attemptsAt("full"), e.attemptsAt("refusing")
	goodBefore := e.attemptCount("good", "healthy", "ok")

	// The refusing engine comes back but stays ejected: kept in rotation
	// by the cap, behind the healthy one.
	require.NoError(t, refusing.SetRefuseConnections(false))
	for range 30 {
		resp := e.post(RouteChat, tok, chatBody("g", ""))
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		ev := e.sink.byID(t, resp.Header.Get(oai.RequestIDHeader))
		require.Equal(t, "good", ev.DeploymentId)
		require.Equal(t, int32(1), ev.Attempts)
	}
	var g dto.Metric
	require.NoError(t, e.h.m.poolOut.WithLabelValues("g").Write(&g))
	require.Equal(t, 0.5, g.GetGauge().GetValue(), "at most 50% out of rotation")
	require.Equal(t, refusingBefore, e.attemptsAt("refusing"), "the kept-in deployment is a last resort")
	require.Equal(t, fullBefore, e.attemptsAt("full"))
	require.Equal(t, limitedBefore, e.attemptsAt("limited"), "the 429ing engine receives nothing while parked")
	require.Equal(t, goodBefore+30, e.attemptCount("good", "healthy", "ok"))

	// The healthy one fails (502, retryable): the retry goes to the
	// kept-in one, never to a parked one.
	require.NoError(t, good.SetFaults(vllmsim.Faults{Status: http.StatusBadGateway}))
	resp := e.post(RouteChat, tok, chatBody("g", ""))
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	ev := e.sink.byID(t, resp.Header.Get(oai.RequestIDHeader))
	require.Equal(t, "refusing", ev.DeploymentId)
	require.Equal(t, int32(2), ev.Attempts)
	require.Equal(t, 1.0, e.attemptCount("refusing", "ejected", "ok"))
	require.Equal(t, limitedBefore, e.attemptsAt("limited"))
	require.Equal(t, fullBefore, e.attemptsAt("full"))
}

// TestParkedOnlyWhenNothingElse: a parked deployment kept in rotation by
// the maximum ejection percentage is used when nothing else exists.
func TestParkedOnlyWhenNothingElse(t *testing.T) {
	t.Parallel()
	a := startSim(t, func(c *vllmsim.Config) {
		c.Faults.Status, c.Faults.RetryAfter = http.StatusTooManyRequests, 30*time.Second
	})
	b := startSim(t, func(c *vllmsim.Config) {
		c.Faults.Status, c.Faults.RetryAfter = http.StatusTooManyRequests, 20*time.Second
	})
	e := newEnv(t, manyRetries, func(c *Config) { c.MaxEjectionPercent = 50 })
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("a", "g", a.URL()+"/v1", nil)
	e.deploy("b", "g", b.URL()+"/v1", nil)
	e.apply()
	resp := e.post(RouteChat, tok, chatBody("g", ""))
	ae := readErr(t, resp)
	require.Equal(t, http.StatusTooManyRequests, ae.Status)
	require.Equal(t, "2", ae.Header.Get(oai.HeaderAttempts), "each tried once")
	// Both parked; b's parking ends first: it is kept in, the only
	// candidate.
	require.NoError(t, b.SetFaults(vllmsim.Faults{}))
	resp = e.post(RouteChat, tok, chatBody("g", ""))
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	ev := e.sink.byID(t, resp.Header.Get(oai.RequestIDHeader))
	require.Equal(t, "b", ev.DeploymentId)
	require.Equal(t, 1.0, e.attemptCount("b", "parked", "ok"))
	require.Equal(t, 1.0, e.attemptsAt("a"))
}

// TestHalfOpenProbe (vLLM simulators): a deployment cutting its streams
// mid-way is ejected after 3 cuts (one at a time: no other stream in
// flight); when its backoff ends it is half-open and takes a single probe
// however many requests arrive; the probe's stream is held back, so its
// cut reaches no client (retried elsewhere: every stream ends with
// [DONE]) and ejects it again at once for twice the backoff; once it
// serves again, its next probe succeeds and it is back in full.
func TestHalfOpenProbe(t *testing.T) {
	t.Parallel()
	cutter := startSim(t, func(c *vllmsim.Config) { c.Faults.CutAfterChunks = 2 })
	good := startSim(t, nil)
	e := newEnv(t, func(c *Config) { c.EjectionBase, c.EjectionMax = time.Second, 10*time.Second })
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("cutter", "g", cutter.URL()+"/v1", func(d *configv1.Deployment) { d.Weight = 1000 })
	e.deploy("good", "g", good.URL()+"/v1", nil)
	e.apply()
	h := &e.h.states.Get("cutter").Health
	stream := func() (deployment string, done bool) {
		resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
		data := sseData(t, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		return e.sink.byID(t, resp.Header.Get(oai.RequestIDHeader)).DeploymentId, data[len(data)-1] == "[DONE]"
	}
	cuts := 0
	for !h.Ejected(time.Now()) {
		dep, done := stream()
		if dep == "cutter" {
			require.False(t, done)
			cuts++
		}
		require.LessOrEqual(t, cuts, 3, "ejected after 3 cuts")
	}
	require.Equal(t, 3, cuts)
	first := h.EjectedUntil()

	// Its backoff ends: 8 concurrent streams, one probe.
	waitFor(t, "the end of the ejection", func() bool { return h.HalfOpen(time.Now()) })
	var wg sync.WaitGroup
	var mu sync.Mutex
	var last []string
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp := e.post(RouteChat, tok, chatBody("g", `"stream":true`))
			data := sseData(t, resp.Body)
			resp.Body.Close()
			mu.Lock()
			last = append(last, resp.Status+" "+data[len(data)-1])
			mu.Unlock()
		}()
	}
	wg.Wait()
	require.Equal(t, 1.0, e.attemptCount("cutter", "probe", "retryable"), "one probe, cut while held back, retried")
	require.Zero(t, e.attemptCount("cutter", "probe", "failed"), "the probe's cut reached its client")
	for _, l := range last {
		require.Equal(t, "200 OK [DONE]", l, "a stream at the return was cut")
	}
	require.Equal(t, 3.0, e.attemptCount("cutter", "healthy", "failed"))
	require.True(t, h.Ejected(time.Now()), "the failed probe ejects it again")
	second := h.EjectedUntil()
	require.GreaterOrEqual(t, second.Sub(first), 2*time.Second, "ejected again at the probe, for twice the backoff (2 s)")
	require.Less(t, second.Sub(first), 3*time.Second)

	// It serves again: the next probe succeeds and closes it.
	require.NoError(t, cutter.SetFaults(vllmsim.Faults{}))
	waitFor(t, "the second return", func() bool { return h.HalfOpen(time.Now()) })
	for i := 0; h.HalfOpen(time.Now()); i++ {
		require.Less(t, i, 100)
		stream()
	}
	require.Equal(t, 1.0, e.attemptCount("cutter", "probe", "ok"))
	for e.attemptCount("cutter", "healthy", "ok") == 0 {
		_, done := stream()
		require.True(t, done)
	}
	require.False(t, h.Ejected(time.Now()))
}

// TestRetryGoesToHealthyNow (vLLM simulators): a retry re-reads the
// health of the untried candidates. The request's candidates are A, then
// its fallback groups' B and C, in that order; while its attempt on A
// runs (1 s, then 502), B answers another request 429 with Retry-After
// 30 s and is parked: the retry goes to C, the one healthy now, not to B.
func TestRetryGoesToHealthyNow(t *testing.T) {
	t.Parallel()
	a := startSim(t, func(c *vllmsim.Config) { c.Faults.Status, c.Faults.Delay = http.StatusBadGateway, time.Second })
	b := startSim(t, nil)
	c := startSim(t, nil)
	e := newEnv(t, manyRetries)
	e.snap.ModelGroups = append(e.snap.ModelGroups,
		&configv1.ModelGroup{PlatformWide: true, Name: "p", Fallbacks: []string{"fb", "fc"}},
		&configv1.ModelGroup{PlatformWide: true, Name: "fb"}, &configv1.ModelGroup{PlatformWide: true, Name: "fc"})
	e.deploy("A", "p", a.URL()+"/v1", nil)
	e.deploy("B", "fb", b.URL()+"/v1", nil)
	e.deploy("C", "fc", c.URL()+"/v1", nil)
	tok := e.key("k1", nil)
	e.apply()
	type answer struct {
		status int
		id     string
	}
	done := make(chan answer, 1)
	go func() {
		resp := e.post(RouteChat, tok, chatBody("p", ""))
		resp.Body.Close()
		done <- answer{resp.StatusCode, resp.Header.Get(oai.RequestIDHeader)}
	}()
	inFlight := func(id string) float64 {
		var m dto.Metric
		require.NoError(t, e.h.series.upstreamInFlight(id).Write(&m))
		return m.GetGauge().GetValue()
	}
	waitFor(t, "the attempt on A", func() bool { return inFlight("A") == 1 })
	require.NoError(t, b.SetFaults(vllmsim.Faults{Status: http.StatusTooManyRequests, RetryAfter: 30 * time.Second}))
	ae := readErr(t, e.post(RouteChat, tok, chatBody("fb", "")))
	require.Equal(t, http.StatusTooManyRequests, ae.Status)
	require.NoError(t, b.SetFaults(vllmsim.Faults{})) // it would serve, but asked for 30 s of peace
	require.Equal(t, 1.0, inFlight("A"), "A's attempt still runs")
	got := <-done
	require.Equal(t, http.StatusOK, got.status)
	ev := e.sink.byID(t, got.id)
	require.Equal(t, "C", ev.DeploymentId, "the retry went to the deployment healthy at the retry")
	require.Equal(t, int32(2), ev.Attempts)
	require.Equal(t, 1.0, e.attemptsAt("B"), "B received only the request that parked it")
}
