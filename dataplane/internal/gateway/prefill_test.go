package gateway

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/admission"
	"github.com/sluicegw/sluice/dataplane/internal/affinity"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/redisconn"
	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// gatedUpstream is an engine whose streams produce their first token only
// when the test says so (first), and end when it says so (done): the
// test decides how long each request stays in prefill.
type gatedUpstream struct {
	name     string
	url      string
	arrived  chan *gatedReq
	stopCh   chan struct{}
	stopOnce sync.Once
}

// stop ends every request still held (tests defer it, so that the
// proxies' servers, closed by cleanups, find no request left open).
func (g *gatedUpstream) stop() { g.stopOnce.Do(func() { close(g.stopCh) }) }

type gatedReq struct {
	up          *gatedUpstream
	first, done chan struct{}
}

func (r *gatedReq) firstToken() { close(r.first) }
func (r *gatedReq) finish()     { close(r.done) }

func startGated(t *testing.T, name string) *gatedUpstream {
	t.Helper()
	g := &gatedUpstream{name: name, arrived: make(chan *gatedReq, 64)}
	g.stopCh = make(chan struct{})
	stop := g.stopCh // the test ended: every request ends
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		req := &gatedReq{up: g, first: make(chan struct{}), done: make(chan struct{})}
		g.arrived <- req
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		fl := w.(http.Flusher)
		fl.Flush()
		select {
		case <-req.first:
		case <-r.Context().Done():
			return
		case <-stop:
			return
		}
		fmt.Fprint(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"hi\"}}]}\n\n")
		fl.Flush()
		select {
		case <-req.done:
		case <-r.Context().Done():
			return
		case <-stop:
			return
		}
		fmt.Fprint(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":1,\"total_tokens\":11}}\n\ndata: [DONE]\n\n")
		fl.Flush()
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(g.stop)
	g.url = srv.URL + "/v1"
	return g
}

// next waits for the next request to reach the engine.
func (g *gatedUpstream) next(t *testing.T) *gatedReq {
	t.Helper()
	select {
	case r := <-g.arrived:
		return r
	case <-time.After(10 * time.Second):
		t.Fatalf("no request reached engine %s", g.name)
		return nil
	}
}

// nextOf waits for the next request to reach either engine.
func nextOf(t *testing.T, a, b *gatedUpstream) *gatedReq {
	t.Helper()
	select {
	case r := <-a.arrived:
		return r
	case r := <-b.arrived:
		return r
	case <-time.After(10 * time.Second):
		t.Fatalf("no request reached %s or %s", a.name, b.name)
		return nil
	}
}

// prefillOf reads deployment id's fleet-wide prefill tokens in flight.
func (le *limitsEnv) prefillOf(id string) int64 {
	v, err := le.rdb.HGet(context.Background(), le.lim.DeploymentPrefillKey(id), limits.PrefillField).Result()
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseInt(v, 10, 64)
	return n
}

// longChat is a streamed chat whose prompt is about words×1.25 tokens
// (the proxy's estimate: 4 bytes a token).
func longChat(model string, words int, tag string) string {
	return `{"model":"` + model + `","messages":[{"role":"user","content":"` + tag + " " + strings.Repeat("word ", words) + `"}],"max_tokens":5,"stream":true}`
}

type posted struct {
	resp *http.Response
	body string
}

// postAsync posts in the background (a stream's answer starts only at its
// first token) and returns where its answer arrives.
func postAsync(e *env, tok, body string, hdr ...string) chan posted {
	out := make(chan posted, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, e.srv.URL+RouteChat, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+tok)
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			out <- posted{}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		out <- posted{resp: resp, body: string(b)}
	}()
	return out
}

func awaitPosted(t *testing.T, ch chan posted) posted {
	t.Helper()
	select {
	case p := <-ch:
		require.NotNil(t, p.resp, "the request failed")
		return p
	case <-time.After(10 * time.Second):
		t.Fatal("no answer")
		return posted{}
	}
}

// memReleases carries release notifications between the proxies of a
// test in memory (as NATS does between a fleet's: admission.Releases).
type memReleases struct {
	mu      sync.Mutex
	next    int
	watches map[string]map[int]func()
}

func (m *memReleases) Publish(group string) {
	m.mu.Lock()
	var wakes []func()
	for _, w := range m.watches[group] {
		wakes = append(wakes, w)
	}
	m.mu.Unlock()
	for _, w := range wakes {
		w()
	}
}

func (m *memReleases) Watch(group string, wake func()) func() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.watches == nil {
		m.watches = map[string]map[int]func(){}
	}
	if m.watches[group] == nil {
		m.watches[group] = map[int]func(){}
	}
	m.next++
	id := m.next
	m.watches[group][id] = wake
	return func() {
		m.mu.Lock()
		delete(m.watches[group], id)
		m.mu.Unlock()
	}
}

// TestPrefillCapQueues: across two proxies, an agent request that would
// take a deployment past its max_prefill_tokens_in_flight waits in the
// admission queue while other requests are in prefill, is released when
// their first tokens arrive (woken across proxies by the first-token
// release notification, not the retry interval), and an interactive request is never held by the
// cap (but counts in the prefill in flight).
func TestPrefillCapQueues(t *testing.T) {
	bounds := admission.Bounds{{MaxLength: 4, Timeout: 20 * time.Second}, {MaxLength: 4, Timeout: 20 * time.Second}, {}}
	// A retry interval longer than the test: a queued request is woken
	// by release notifications only.
	rel := &memReleases{}
	withQueues := func(c *Config) {
		c.AdmissionQueues, c.AdmissionRetryInterval, c.Releases = bounds, time.Minute, rel
	}
	le := newLimitsEnv(t, withQueues)
	up := startGated(t, "e1")
	defer up.stop()
	le.group("m")
	le.deploy("d1", "m", up.url, func(d *configv1.Deployment) {
		d.MaxConcurrency = 8
		d.Traffic = &configv1.DeploymentTraffic{MaxPrefillTokensInFlight: 1000}
	})
	agent := le.key("agent", func(k *configv1.Key) { k.TrafficClass = classAgent })
	inter := le.key("inter", func(k *configv1.Key) { k.TrafficClass = classInteractive })
	le.apply()
	other := newEnv(t, func(c *Config) { c.Limiter = le.lim; withQueues(c) })
	other.snap = le.snap
	other.apply()

	// A: an agent prompt of ~640 estimated tokens, in prefill.
	aDone := postAsync(le.env, agent, longChat("m", 500, "a"))
	a := up.next(t)
	estA := le.prefillOf("d1")
	require.Greater(t, estA, int64(500), "A's prompt estimate is in the deployment's prefill in flight")
	require.LessOrEqual(t, estA, int64(1000))

	// B, through the other proxy: A + B exceed the cap, so B waits.
	bDone := postAsync(other, agent, longChat("m", 500, "b"))
	waitFor(t, "B queued by the prefill cap", func() bool { return other.h.queues.Backlog().Classes["agent"].Queued == 1 })
	require.Empty(t, up.arrived, "B did not reach the engine")

	// An interactive request is not capped: it goes at once and counts.
	cDone := postAsync(other, inter, longChat("m", 500, "c"))
	c := up.next(t)
	waitFor(t, "C counted", func() bool { return le.prefillOf("d1") > estA })
	require.EqualValues(t, 1, other.h.queues.Backlog().Classes["agent"].Queued, "B still waits")

	// C's first token: A alone is still in prefill, B still does not fit.
	c.firstToken()
	waitFor(t, "C's prefill moved to zero", func() bool { return le.prefillOf("d1") == estA })
	require.Empty(t, up.arrived)
	require.EqualValues(t, 1, other.h.queues.Backlog().Classes["agent"].Queued)

	// A's first token frees the prefill room: B is admitted, through the
	// release notification (the retry interval is a minute).
	t0 := time.Now()
	a.firstToken()
	b := up.next(t)
	t.Logf("B reached the engine %s after A's first token", time.Since(t0))
	require.Less(t, time.Since(t0), 5*time.Second)
	waitFor(t, "B's prefill counted alone", func() bool { p := le.prefillOf("d1"); return p > 500 && p <= 1000 })
	b.firstToken()
	waitFor(t, "no prefill in flight", func() bool { return le.prefillOf("d1") == 0 })

	for _, r := range []*gatedReq{a, b, c} {
		r.finish()
	}
	for _, ch := range []chan posted{aDone, bDone, cDone} {
		p := awaitPosted(t, ch)
		require.Equal(t, http.StatusOK, p.resp.StatusCode, p.body)
	}
	for _, e := range []*env{le.env, other} {
		require.NoError(t, e.h.Drain(context.Background()))
	}
	waitFor(t, "every lease released", func() bool { return le.leases() == 0 })
	require.Zero(t, le.prefillOf("d1"))
	require.Equal(t, uint64(0), other.h.queues.Backlog().Classes["agent"].Rejected)

	// A shed request (its queue timeout) leaves no prefill behind either.
	hold := postAsync(le.env, agent, longChat("m", 500, "h"))
	var h *gatedReq
	select {
	case h = <-up.arrived:
	case p := <-hold:
		t.Fatalf("the held request ended: %d %s", p.resp.StatusCode, p.body)
	}
	bounds[1].Timeout = 300 * time.Millisecond
	shedEnv := newEnv(t, func(c *Config) { c.Limiter = le.lim; c.AdmissionQueues = bounds })
	shedEnv.snap = le.snap
	shedEnv.apply()
	er := readErr(t, shedEnv.post(RouteChat, agent, longChat("m", 500, "s")))
	require.Equal(t, 503, er.Status)
	require.Equal(t, oai.CodeOverloaded, er.Error.Code)
	require.Equal(t, estA, le.prefillOf("d1"), "only the held request's prefill")
	h.firstToken()
	h.finish()
	require.Equal(t, http.StatusOK, awaitPosted(t, hold).resp.StatusCode)

	// A group without prefill isolation never calls a gate.
	gates, err := le.rdb.Keys(context.Background(), le.prefix+"{g:*").Result()
	require.NoError(t, err)
	require.Empty(t, gates)
}

// TestInteractiveLeastPrefill: an interactive request (group without a
// strategy) goes to the candidate with the least fleet-wide prefill in
// flight, whichever proxy admitted the requests in prefill.
func TestInteractiveLeastPrefill(t *testing.T) {
	le := newLimitsEnv(t)
	pipe, err := redispipe.New(redispipe.Options{Addr: redisAddr})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pipe.Close() })
	store, err := affinity.New(affinity.Config{Conn: &redisconn.Conn{Pipe: pipe}, KeyPrefix: le.prefix})
	require.NoError(t, err)
	le.h.cfg.Affinity = store
	require.NoError(t, le.lim.Bootstrap(context.Background(), limits.DeploymentOrg("d2")))
	e1, e2 := startGated(t, "d1"), startGated(t, "d2")
	defer e1.stop()
	defer e2.stop()
	le.group("m")
	for _, d := range []struct {
		id string
		up *gatedUpstream
	}{{"d1", e1}, {"d2", e2}} {
		le.deploy(d.id, "m", d.up.url, func(d *configv1.Deployment) { d.MaxConcurrency = 4 })
	}
	agent := le.key("agent", func(k *configv1.Key) { k.TrafficClass = classAgent })
	inter := le.key("inter", func(k *configv1.Key) { k.TrafficClass = classInteractive })
	le.apply()
	other := newEnv(t, func(c *Config) { c.Limiter = le.lim; c.Affinity = store })
	other.snap = le.snap
	other.apply()

	for round := range 4 {
		// An agent's long prompt in prefill on one of the engines
		// (wherever its prefix hashes), through the first proxy.
		aDone := postAsync(le.env, agent, longChat("m", 2000, "agent round "+strconv.Itoa(round)))
		a := nextOf(t, e1, e2)
		busy, idle := "d1", "d2"
		idleUp := e2
		if a.up == e2 {
			busy, idle, idleUp = "d2", "d1", e1
		}
		waitFor(t, "the agent's prefill counted", func() bool { return le.prefillOf(busy) > 2000 })
		// Chats through the other proxy go to the engine without prefill.
		for i := range 3 {
			cDone := postAsync(other, inter, chatBody("m", `"stream":true`))
			c := idleUp.next(t)
			c.firstToken()
			c.finish()
			p := awaitPosted(t, cDone)
			require.Equal(t, http.StatusOK, p.resp.StatusCode, p.body)
			ev := other.sink.byID(t, p.resp.Header.Get(oai.RequestIDHeader))
			require.Equal(t, idle, ev.DeploymentId, "round %d chat %d: the deployment without prefill", round, i)
			require.Contains(t, []string{reasonPrefill, reasonShuffle}, ev.RoutingReason)
		}
		a.firstToken()
		waitFor(t, "the agent's prefill moved to zero", func() bool { return le.prefillOf(busy) == 0 })
		a.finish()
		require.Equal(t, http.StatusOK, awaitPosted(t, aDone).resp.StatusCode)
	}
	n := 0
	for _, ev := range other.sink.events() {
		if ev.RoutingReason == reasonPrefill {
			n++
		}
	}
	t.Logf("%d of 12 chats were moved off the shuffle's first choice by prefill in flight", n)
}

// TestExplainShowsPrefillInFlight: explain shows each candidate's
// fleet-wide prefill tokens in flight and its prefill cap, and says when
// the cap would skip it (an agent request that does not fit beside the
// prefill in flight); an interactive request is never capped.
func TestExplainShowsPrefillInFlight(t *testing.T) {
	le := newLimitsEnv(t)
	up := startGated(t, "e1")
	defer up.stop()
	le.group("m")
	le.deploy("d1", "m", up.url, func(d *configv1.Deployment) {
		d.MaxConcurrency = 8
		d.Traffic = &configv1.DeploymentTraffic{MaxPrefillTokensInFlight: 1000}
	})
	agent := le.key("agent", func(k *configv1.Key) { k.TrafficClass = classAgent })
	le.key("inter", func(k *configv1.Key) { k.TrafficClass = classInteractive })
	le.apply()
	explain := func(key string) *configv1.ExplainDeployment {
		t.Helper()
		tr, err := le.h.Explain(context.Background(), ExplainScope{}, &configv1.ExplainQuery{KeyId: key, Model: "m", PromptBytes: 2000})
		require.NoError(t, err)
		require.Len(t, tr.GetDeployments(), 1)
		d := tr.GetDeployments()[0]
		require.EqualValues(t, 1000, d.GetMaxPrefillTokensInFlight())
		require.NotNil(t, d.PrefillTokensInFlight, "the fleet-wide count was read")
		require.Positive(t, d.GetPrefillEstimate())
		capped := false
		for _, n := range tr.GetNotes() {
			capped = capped || strings.Contains(n, "deployment d1 is skipped for its prefill cap")
		}
		require.Equal(t, d.GetPrefillCapped(), capped, "a capped candidate is named in the notes: %v", tr.GetNotes())
		return d
	}
	d := explain("agent")
	require.Zero(t, d.GetPrefillTokensInFlight())
	require.False(t, d.GetPrefillCapped(), "no prefill in flight: any request fits")

	// A: an agent prompt of ~640 estimated tokens, in prefill.
	aDone := postAsync(le.env, agent, longChat("m", 500, "a"))
	a := up.next(t)
	estA := le.prefillOf("d1")
	require.Greater(t, estA, int64(500))
	d = explain("agent")
	require.Equal(t, estA, d.GetPrefillTokensInFlight())
	require.Greater(t, estA+d.GetPrefillEstimate(), int64(1000))
	require.True(t, d.GetPrefillCapped(), "A + this request exceed the cap")
	d = explain("inter")
	require.Equal(t, estA, d.GetPrefillTokensInFlight())
	require.False(t, d.GetPrefillCapped(), "interactive requests are never held by the cap")

	a.firstToken()
	waitFor(t, "A's prefill moved to zero", func() bool { return le.prefillOf("d1") == 0 })
	require.False(t, explain("agent").GetPrefillCapped())
	a.finish()
	require.Equal(t, http.StatusOK, awaitPosted(t, aDone).resp.StatusCode)
}

// TestPrefillIsolation: a model group with prefill_isolation 1 and two
// deployments, two proxies. While one deployment has agent prefill in
// flight an agent request never starts prefill on the other (it joins
// the busy one, or waits in the queue when that one has no slot), an
// interactive request goes to the free one, and an agent waiting at the
// gate is woken across proxies by the first token that ends the busy
// deployment's prefill (the retry interval is a minute).
func TestPrefillIsolation(t *testing.T) {
	bounds := admission.Bounds{{MaxLength: 4, Timeout: 20 * time.Second}, {MaxLength: 4, Timeout: 20 * time.Second}, {}}
	rel := &memReleases{}
	withQueues := func(c *Config) {
		c.AdmissionQueues, c.AdmissionRetryInterval, c.Releases = bounds, time.Minute, rel
	}
	le := newLimitsEnv(t, withQueues)
	for _, d := range []string{"d1", "d2"} {
		require.NoError(t, le.lim.Bootstrap(context.Background(), limits.DeploymentOrg(d)))
	}
	e1, e2 := startGated(t, "d1"), startGated(t, "d2")
	defer e1.stop()
	defer e2.stop()
	le.snap.ModelGroups = append(le.snap.ModelGroups, &configv1.ModelGroup{Name: "m", PlatformWide: true,
		Traffic: &configv1.ModelGroupTraffic{PrefillIsolation: 1}})
	// Two agent slots each (a third is reserved for interactive
	// requests): the first agent and a joining one fill the busy
	// deployment's, so a third agent has nowhere to start but the free one.
	for _, d := range []struct {
		id string
		up *gatedUpstream
	}{{"d1", e1}, {"d2", e2}} {
		le.deploy(d.id, "m", d.up.url, func(d *configv1.Deployment) {
			d.MaxConcurrency = 3
			d.Traffic = &configv1.DeploymentTraffic{InteractiveReserve: 1}
		})
	}
	agent := le.key("agent", func(k *configv1.Key) { k.TrafficClass = classAgent })
	inter := le.key("inter", func(k *configv1.Key) { k.TrafficClass = classInteractive })
	le.apply()
	other := newEnv(t, func(c *Config) { c.Limiter = le.lim; withQueues(c) })
	other.snap = le.snap
	other.apply()
	upOf := map[*gatedUpstream]string{e1: "d1", e2: "d2"}

	// A: agent prefill on one deployment (the busy one).
	aDone := postAsync(le.env, agent, longChat("m", 500, "a"))
	a := nextOf(t, e1, e2)
	busyUp, freeUp := a.up, e2
	if busyUp == e2 {
		freeUp = e1
	}
	busy, free := upOf[busyUp], upOf[freeUp]

	// B, through the other proxy, wherever its order starts: it joins
	// the busy deployment, never the free one.
	bDone := postAsync(other, agent, longChat("m", 500, "b"))
	b := nextOf(t, e1, e2)
	require.Same(t, busyUp, b.up, "an agent never starts prefill on the free deployment while %s has agent prefill", busy)

	// A chat goes to the free deployment, through either proxy.
	for i, e := range []*env{le.env, other} {
		cDone := postAsync(e, inter, chatBody("m", `"stream":true`))
		c := nextOf(t, e1, e2)
		require.Same(t, freeUp, c.up, "chat %d: the deployment without agent prefill", i)
		c.firstToken()
		c.finish()
		p := awaitPosted(t, cDone)
		require.Equal(t, http.StatusOK, p.resp.StatusCode, p.body)
		ev := e.sink.byID(t, p.resp.Header.Get(oai.RequestIDHeader))
		require.Equal(t, free, ev.DeploymentId)
		require.Contains(t, []string{reasonIsolation, reasonPrefill, reasonShuffle}, ev.RoutingReason)
	}

	// C: the busy deployment is full (A and B), the free one is kept
	// free: C waits in the queue and reaches no engine.
	cDone := postAsync(other, agent, longChat("m", 500, "c"))
	waitFor(t, "C queued by the gate", func() bool { return other.h.queues.Backlog().Classes["agent"].Queued == 1 })
	require.Empty(t, e1.arrived)
	require.Empty(t, e2.arrived)

	// A's first token leaves B in prefill: C still waits.
	a.firstToken()
	require.Never(t, func() bool { return len(freeUp.arrived) > 0 }, 300*time.Millisecond, 20*time.Millisecond,
		"C must not start on %s while B is in prefill on %s", free, busy)
	// B's first token ends the busy deployment's agent prefill: C is
	// woken (by the release notification) and starts on the free one.
	t0 := time.Now()
	b.firstToken()
	c := freeUp.next(t)
	t.Logf("C reached %s %s after B's first token", free, time.Since(t0))
	require.Less(t, time.Since(t0), 5*time.Second)

	// Now the other deployment has the agent prefill: a chat goes to the
	// first one (its agents decoding only).
	chDone := postAsync(le.env, inter, chatBody("m", `"stream":true`))
	ch := busyUp.next(t)
	ch.firstToken()
	ch.finish()
	require.Equal(t, http.StatusOK, awaitPosted(t, chDone).resp.StatusCode)

	c.firstToken()
	for _, r := range []*gatedReq{a, b, c} {
		r.finish()
	}
	for _, done := range []chan posted{aDone, bDone, cDone} {
		p := awaitPosted(t, done)
		require.Equal(t, http.StatusOK, p.resp.StatusCode, p.body)
	}
	require.Zero(t, other.h.queues.Backlog().Classes["agent"].Rejected)
	// C tried once per wake-up (the releases above), not in a loop. Its
	// tries while the group was full each left a gate entry on the busy
	// deployment when the lease was refused; that leave woke C itself
	// when it woke the group's waiters, so C tried again at once: thousands of
	// gate and lease calls per second until B's first token (dropGate).
	var tries float64
	for _, o := range []string{gateEntered, "refused_isolation", "refused_interactive", "refused_run"} {
		tries += counterValue(other.h.gateM.WithLabelValues("m", "agent", o))
	}
	require.Less(t, tries, 50.0, "gate decisions of B and C on the second proxy")
}
