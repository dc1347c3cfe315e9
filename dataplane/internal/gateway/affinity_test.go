package gateway

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

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
