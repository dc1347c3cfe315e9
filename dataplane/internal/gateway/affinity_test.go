package gateway

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/affinity"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/redisconn"
	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// affinityEnv is a limits env with an affinity store on the same Redis
// and prefix, and two simulator deployments of group g.
type affinityEnv struct {
	*limitsEnv
	store *affinity.Store
	tok   string
}

func newAffinityEnv(t *testing.T, edit func(d *configv1.Deployment)) *affinityEnv {
	t.Helper()
	return newAffinityEnvVia(t, redisAddr, 0, edit)
}

// newAffinityEnvVia is newAffinityEnv with the affinity store reaching
// Redis at addr (a relay in front of it) with the given call timeout (0:
// the default); the limits keep the direct connection.
func newAffinityEnvVia(t *testing.T, addr string, callTimeout time.Duration, edit func(d *configv1.Deployment)) *affinityEnv {
	t.Helper()
	le := newLimitsEnv(t)
	var conn *redisconn.Conn
	if le.cluster != nil {
		// On a Redis Cluster (TestRoutingOnCluster) the store shares the
		// limiter's connection, as in a data plane.
		conn = le.cluster
		if callTimeout == 0 {
			callTimeout = time.Second // a Cluster client's first calls load the slot map and dial every node
		}
	} else {
		pipe, err := redispipe.New(redispipe.Options{Addr: addr})
		require.NoError(t, err)
		t.Cleanup(func() { _ = pipe.Close() })
		conn = &redisconn.Conn{Pipe: pipe}
	}
	store, err := affinity.New(affinity.Config{Conn: conn, KeyPrefix: le.prefix, CallTimeout: callTimeout})
	require.NoError(t, err)
	le.h.cfg.Affinity = store // before any request
	ae := &affinityEnv{limitsEnv: le, store: store}
	require.NoError(t, le.lim.Bootstrap(context.Background(), limits.DeploymentOrg("d2")))
	le.group("g")
	for _, id := range []string{"d1", "d2"} {
		sim := startSim(t, nil)
		le.deploy(id, "g", sim.URL()+"/v1", edit)
	}
	ae.tok = le.key("k1", nil)
	le.apply()
	return ae
}

// call sends one chat request and returns its usage event.
func (ae *affinityEnv) call(body string, hdr ...string) *usagev1.UsageEvent {
	ae.t.Helper()
	resp := ae.post("/v1/chat/completions", ae.tok, body, hdr...)
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	require.Equal(ae.t, http.StatusOK, resp.StatusCode)
	return ae.sink.byID(ae.t, resp.Header.Get(oai.RequestIDHeader))
}

func (ae *affinityEnv) pin(session string) string {
	v, _ := ae.rdb.Get(context.Background(), ae.store.PinKey("o1", "g", session)).Result()
	return v
}

func (ae *affinityEnv) waitPin(session, want string) {
	ae.t.Helper()
	waitFor(ae.t, "pin of "+session+" = "+want, func() bool { return ae.pin(session) == want })
}

func TestSessionAffinity(t *testing.T) {
	ae := newAffinityEnv(t, nil)
	first := ae.call(chatBody("g", ""), "x-session-id", "s1")
	require.Equal(t, reasonLoad, first.RoutingReason, "a new session is placed by rendezvous")
	ae.waitPin("s1", first.DeploymentId)
	ttl, err := ae.rdb.PTTL(context.Background(), ae.store.PinKey("o1", "g", "s1")).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, 59*time.Minute)
	for range 20 {
		ev := ae.call(chatBody("g", ""), "x-session-id", "s1")
		require.Equal(t, first.DeploymentId, ev.DeploymentId)
		require.Equal(t, reasonSession, ev.RoutingReason)
	}
	// Any x-<name>-session-id is a session id too.
	ev := ae.call(chatBody("g", ""), "x-litellm-session-id", "s2")
	ae.waitPin("s2", ev.DeploymentId)
	for range 5 {
		require.Equal(t, ev.DeploymentId, ae.call(chatBody("g", ""), "x-litellm-session-id", "s2").DeploymentId)
	}
	require.GreaterOrEqual(t, counterValue(ae.h.affm.decisions.WithLabelValues("session", "hit")), 25.0)
}

// A pin to a deployment the request's capabilities filter out is never
// used, and is kept for the session's next request.
func TestSessionPinAfterFilters(t *testing.T) {
	ae := newAffinityEnv(t, func(d *configv1.Deployment) {
		if d.Id == "d2" {
			d.Capabilities = &configv1.Capabilities{Tools: true}
		}
	})
	require.NoError(t, ae.store.Pin(context.Background(), ae.store.PinKey("o1", "g", "s1"), "d1", time.Hour))
	tools := `"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]`
	for range 5 {
		ev := ae.call(chatBody("g", tools), "x-session-id", "s1")
		require.Equal(t, "d2", ev.DeploymentId)
		require.Equal(t, reasonLoad, ev.RoutingReason)
	}
	require.Equal(t, "d1", ae.pin("s1"), "the pin is kept")
	ev := ae.call(chatBody("g", ""), "x-session-id", "s1")
	require.Equal(t, "d1", ev.DeploymentId)
	require.Equal(t, reasonSession, ev.RoutingReason)
	require.Equal(t, 5.0, counterValue(ae.h.affm.decisions.WithLabelValues("session", "override")))
}

// A full pinned deployment is skipped for one request; the next returns.
func TestSessionPinFull(t *testing.T) {
	ae := newAffinityEnv(t, func(d *configv1.Deployment) { d.MaxConcurrency = 1 })
	require.NoError(t, ae.store.Pin(context.Background(), ae.store.PinKey("o1", "g", "s1"), "d1", time.Hour))
	slots := &ae.h.states.Get("d1").Slots
	require.True(t, slots.TryAcquire(1))
	ev := ae.call(chatBody("g", ""), "x-session-id", "s1")
	require.Equal(t, "d2", ev.DeploymentId)
	require.Equal(t, reasonFallback, ev.RoutingReason)
	slots.Release()
	require.Equal(t, "d1", ae.pin("s1"))
	ev = ae.call(chatBody("g", ""), "x-session-id", "s1")
	require.Equal(t, "d1", ev.DeploymentId)
	require.Equal(t, reasonSession, ev.RoutingReason)
	ae.drained()
}

// A pin to a deployment that no longer exists is replaced.
func TestSessionPinGone(t *testing.T) {
	ae := newAffinityEnv(t, nil)
	require.NoError(t, ae.store.Pin(context.Background(), ae.store.PinKey("o1", "g", "s1"), "d-removed", time.Hour))
	ev := ae.call(chatBody("g", ""), "x-session-id", "s1")
	ae.waitPin("s1", ev.DeploymentId)
	require.Equal(t, 1.0, counterValue(ae.h.affm.decisions.WithLabelValues("session", "dropped")))
}

// Without a session, a long shared prefix goes to one replica (agent
// traffic: interactive requests without a session are shuffled by
// default, TestStrategyDefaultsByClass).
func TestPrefixAffinity(t *testing.T) {
	ae := newAffinityEnv(t, nil)
	ae.setClass(configv1.TrafficClass_TRAFFIC_CLASS_AGENT)
	system := strings.Repeat("You are a meticulous assistant for the Sluice test suite. ", 60)
	body := func(turn string) string {
		return `{"model":"g","max_tokens":8,"messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"` + turn + `"}]}`
	}
	first := ae.call(body("q0"))
	require.Equal(t, reasonPrefix, first.RoutingReason)
	for i := range 10 {
		ev := ae.call(body(strings.Repeat("q", i+1)))
		require.Equal(t, first.DeploymentId, ev.DeploymentId)
		require.Equal(t, reasonPrefix, ev.RoutingReason)
	}
	// Short prompts are shuffled.
	require.Equal(t, reasonShuffle, ae.call(chatBody("g", "")).RoutingReason)
}

// New sessions are placed on the deployments' live sessions (pinned, or
// placed while their first turn runs), fleet-wide: 16 sessions over 4
// deployments land 4 on each, though each is between turns (nothing in
// flight) when the next is placed; every later turn stays on its pin.
func TestNewSessionsBalanced(t *testing.T) {
	ae := newAffinityEnv(t, nil)
	for _, id := range []string{"d3", "d4"} {
		sim := startSim(t, nil)
		ae.deploy(id, "g", sim.URL()+"/v1", nil)
	}
	ae.apply()
	per := map[string]int{}
	pins := map[string]string{}
	for i := range 16 {
		s := "bal-" + strconv.Itoa(i)
		ev := ae.call(chatBody("g", ""), "x-session-id", s)
		require.Equal(t, reasonLoad, ev.RoutingReason)
		ae.waitPin(s, ev.DeploymentId)
		per[ev.DeploymentId]++
		pins[s] = ev.DeploymentId
	}
	require.Equal(t, map[string]int{"d1": 4, "d2": 4, "d3": 4, "d4": 4}, per)
	for s, dep := range pins {
		ev := ae.call(chatBody("g", ""), "x-session-id", s)
		require.Equal(t, dep, ev.DeploymentId)
		require.Equal(t, reasonSession, ev.RoutingReason)
	}
	ctx := context.Background()
	for _, id := range []string{"d1", "d2", "d3", "d4"} {
		n, err := ae.rdb.ZCard(ctx, ae.store.SessionsKey(id)).Result()
		require.NoError(t, err)
		require.Equal(t, int64(4), n, id)
	}
	ae.drained()
}

// A new session whose first turn fails is not counted: its placement is
// withdrawn and no pin is written.
func TestNewSessionFailedNotCounted(t *testing.T) {
	ae := newAffinityEnv(t, func(d *configv1.Deployment) { d.ApiBase = "http://127.0.0.1:1/v1" })
	resp := ae.post("/v1/chat/completions", ae.tok, chatBody("g", ""), "x-session-id", "s-fail")
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	require.GreaterOrEqual(t, resp.StatusCode, 500)
	ctx := context.Background()
	waitFor(t, "no live session counted", func() bool {
		n1, _ := ae.rdb.ZCard(ctx, ae.store.SessionsKey("d1")).Result()
		n2, _ := ae.rdb.ZCard(ctx, ae.store.SessionsKey("d2")).Result()
		return n1+n2 == 0
	})
	require.Empty(t, ae.pin("s-fail"))
}

// A new session counts on the deployment it was placed on while its
// first turn runs (before its pin is written), so that the sessions
// placed meanwhile, by any proxy, see it; its pin's call then keeps it
// counted once.
func TestNewSessionCountedWhileFirstTurnRuns(t *testing.T) {
	g1, g2 := startGated(t, "d1"), startGated(t, "d2")
	ae := newAffinityEnv(t, func(d *configv1.Deployment) {
		if d.Id == "d1" {
			d.ApiBase = g1.url
		} else {
			d.ApiBase = g2.url
		}
	})
	done := make(chan int, 2)
	go func() {
		resp := ae.post("/v1/chat/completions", ae.tok, chatBody("g", `"stream":true`), "x-session-id", "s-held")
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		done <- resp.StatusCode
	}()
	req := nextOf(t, g1, g2)
	ctx := context.Background()
	sessions := func(id string) int64 {
		n, _ := ae.rdb.ZCount(ctx, ae.store.SessionsKey(id), strconv.FormatInt(time.Now().UnixMilli(), 10), "+inf").Result()
		return n
	}
	waitFor(t, "the held session counted on "+req.up.name, func() bool { return sessions(req.up.name) == 1 })
	require.Empty(t, ae.pin("s-held"), "no pin before the turn ends")
	require.Zero(t, sessions(map[string]string{"d1": "d2", "d2": "d1"}[req.up.name]))
	// A second turn while the first runs (no pin yet) joins it, though
	// its engine now counts one session and the other none.
	go func() {
		resp := ae.post("/v1/chat/completions", ae.tok, chatBody("g", `"stream":true`), "x-session-id", "s-held")
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		done <- resp.StatusCode
	}()
	req2 := nextOf(t, g1, g2)
	require.Equal(t, req.up.name, req2.up.name, "the session's second turn moved")
	for _, r := range []*gatedReq{req, req2} {
		r.firstToken()
		r.finish()
		require.Equal(t, http.StatusOK, <-done)
	}
	ae.waitPin("s-held", req.up.name)
	require.Equal(t, int64(1), sessions(req.up.name))
}

// No cost on the plain path: agent requests (affinity) without a session
// or a long prefix send the affinity store nothing at all (counted at a
// relay in front of its Redis; the limits keep their own connection),
// with several candidates whose fleet-wide loads exist; a session or a
// long prefix does send its lookup through the same relay.
func TestPlainPathNoAffinityRedis(t *testing.T) {
	relay := startSlowRelay(t)
	ae := newAffinityEnvVia(t, relay.addr(), slowCallTimeout, func(d *configv1.Deployment) { d.MaxConcurrency = 16 })
	ae.setClass(configv1.TrafficClass_TRAFFIC_CLASS_AGENT)
	before := relay.sent.Load()
	for range 10 {
		require.Equal(t, reasonShuffle, ae.call(chatBody("g", "")).RoutingReason)
	}
	require.Equal(t, before, relay.sent.Load(), "a plain request sent the affinity store a command")
	require.Equal(t, reasonPrefix, ae.call(longPrefixBody("q")).RoutingReason)
	require.Greater(t, relay.sent.Load(), before, "the relay is the affinity store's path")
	at := relay.sent.Load()
	ae.call(chatBody("g", ""), "x-session-id", "s-plain")
	require.Greater(t, relay.sent.Load(), at)
}

// peer starts a second proxy of ae's fleet: the same catalog, limits,
// usage sink and Redis prefix, and its own affinity store on a direct
// connection to Redis.
func (ae *affinityEnv) peer() *httptest.Server {
	t := ae.t
	pipe, err := redispipe.New(redispipe.Options{Addr: redisAddr})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pipe.Close() })
	store, err := affinity.New(affinity.Config{Conn: &redisconn.Conn{Pipe: pipe}, KeyPrefix: ae.prefix, CallTimeout: slowCallTimeout})
	require.NoError(t, err)
	cfg := ae.h.cfg
	cfg.Affinity, cfg.Registerer, cfg.InstanceID = store, prometheus.NewRegistry(), "i2"
	h, err := New(cfg)
	require.NoError(t, err)
	mux := http.NewServeMux()
	h.Register(mux)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithCancel(context.Background())
	settled := make(chan struct{})
	go func() { defer close(settled); _ = h.RunSettler(ctx) }()
	t.Cleanup(func() { cancel(); <-settled })
	return srv
}

// callVia is call through the proxy at url.
func (ae *affinityEnv) callVia(url, body string, hdr ...string) *usagev1.UsageEvent {
	ae.t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(body))
	require.NoError(ae.t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+ae.tok)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(ae.t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	require.Equal(ae.t, http.StatusOK, resp.StatusCode)
	return ae.sink.byID(ae.t, resp.Header.Get(oai.RequestIDHeader))
}

// A new session's second turn, sent through another proxy the moment the
// first turn's answer arrived, stays on the first turn's deployment even
// when the first proxy's writes reach Redis late (its affinity commands
// held back by a relay): the first turn's placement is in Redis before
// its answer leaves (awaitPlacement). Meanwhile other sessions were
// placed on that deployment, so a second turn that found neither pin nor
// placement would be placed elsewhere. (Before, the placement was written
// beside the answer, and the pin after it, both fire-and-forget: such a
// second turn was placed again, elsewhere, and its pin moved the session
// for good; TestAffinitySessionsAcrossProxies saw 61 of 72 turns on their
// session's engine under load.)
func TestNewSessionNextTurnAcrossProxies(t *testing.T) {
	relay := startSlowCommandRelay(t)
	ae := newAffinityEnvVia(t, relay.addr(), 3*slowCallTimeout, nil)
	b := ae.peer()
	ctx := context.Background()
	live := func(n int) float64 { return float64(time.Now().Add(time.Hour).UnixMilli() + int64(n)) }
	// d2 holds one session: the new session goes to d1.
	require.NoError(t, ae.rdb.ZAdd(ctx, ae.store.SessionsKey("d2"), redis.Z{Score: live(0), Member: "other-0"}).Err())
	relay.setDelay(slowCallTimeout) // every affinity command of proxy A lands a second late (within its 3 s deadline)
	first := ae.call(chatBody("g", ""), "x-session-id", "s-across")
	// Two sessions placed on d1 meanwhile (by other proxies): a second
	// turn that saw nothing of the first would go to d2.
	require.NoError(t, ae.rdb.ZAdd(ctx, ae.store.SessionsKey("d1"), redis.Z{Score: live(1), Member: "other-1"}, redis.Z{Score: live(2), Member: "other-2"}).Err())
	second := ae.callVia(b.URL, chatBody("g", ""), "x-session-id", "s-across")
	require.Equal(t, "d1", first.DeploymentId)
	require.Equal(t, reasonLoad, first.RoutingReason)
	require.Equal(t, "d1", second.DeploymentId, "the session's second turn moved")
	ae.waitPin("s-across", "d1")
	relay.setDelay(0)
}

// A new session whose first turn's lookup timed out (routed on the
// proxy's own loads, no pin written: it might exist) is still counted
// where that turn went, so its next turn, through another proxy with
// Redis answering, reads no pin but stays there instead of being placed
// anew on the live sessions (meanwhile lower elsewhere). (Before, nothing
// was written for it, and the next turn's placement could move the
// session for good.)
func TestNewSessionSlowLookupNextTurnStays(t *testing.T) {
	relay := startSlowRelay(t)
	ae := newAffinityEnvVia(t, relay.addr(), slowCallTimeout, nil)
	b := ae.peer()
	const session = "slow-first-turn"
	placed, other := placement(session)
	relay.setDelay(3 * slowCallTimeout) // the lookup times out
	first := ae.call(chatBody("g", ""), "x-session-id", session)
	require.Equal(t, placed, first.DeploymentId, "a turn whose lookup timed out goes where a new session would")
	ctx := context.Background()
	pinKey := ae.store.PinKey("o1", "g", session)
	waitFor(t, "the session counted on "+placed, func() bool {
		return ae.rdb.ZScore(ctx, ae.store.SessionsKey(placed), pinKey).Err() == nil
	})
	require.Empty(t, ae.pin(session), "no pin written over one that could not be read")
	// Two sessions placed on the first turn's deployment meanwhile: placed
	// anew, the next turn would go to the other one.
	live := float64(time.Now().Add(time.Hour).UnixMilli())
	require.NoError(t, ae.rdb.ZAdd(ctx, ae.store.SessionsKey(placed), redis.Z{Score: live, Member: "other-1"}, redis.Z{Score: live, Member: "other-2"}).Err())
	second := ae.callVia(b.URL, chatBody("g", ""), "x-session-id", session)
	require.Equal(t, placed, second.DeploymentId, "the session's second turn moved to %s", other)
	ae.waitPin(session, placed)
	relay.setDelay(0)
}

// An interactive session's next turn that reads no pin yet (its first
// turn's pin is written after the answer) but finds the session counted
// on a deployment stays there, however much more prefill in flight that
// deployment has: the prefill order moves new sessions only. (Before, it
// moved this turn too, and its pin then moved the session for good: the
// flaky "61 of 72" of TestAffinitySessionsAcrossProxies, a turn 0's
// prefill still counted on its engine when turn 1 looked.)
func TestPlacedSessionNotMovedByPrefill(t *testing.T) {
	ae := newAffinityEnv(t, func(d *configv1.Deployment) { d.MaxConcurrency = 4 })
	ae.setClass(classInteractive)
	ctx := context.Background()
	// d1 has far more prefill in flight than d2 (other sessions' prompts
	// waiting for their first token).
	require.NoError(t, ae.rdb.HSet(ctx, ae.lim.DeploymentPrefillKey("d1"), limits.PrefillField, 100_000).Err())
	// The control: a new session that counts nowhere goes to d2, whatever
	// its rendezvous choice.
	for i := range 4 {
		ev := ae.call(chatBody("g", ""), "x-session-id", "fresh-"+strconv.Itoa(i))
		require.Equal(t, "d2", ev.DeploymentId, "a new session is placed by prefill in flight")
	}
	// A session whose first turn was placed on d1, its pin not written
	// yet: its next turn stays on d1, and pins it there.
	const session = "placed-on-d1"
	pinKey := ae.store.PinKey("o1", "g", session)
	require.NoError(t, ae.store.Place(ctx, ae.store.SessionsKey("d1"), pinKey, "", time.Now()))
	ev := ae.call(chatBody("g", ""), "x-session-id", session)
	require.Equal(t, "d1", ev.DeploymentId, "the session's next turn moved off the deployment it counts on")
	require.Equal(t, reasonLoad, ev.RoutingReason)
	ae.waitPin(session, "d1")
}
