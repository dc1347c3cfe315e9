package gateway

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/admission"
	"github.com/sluicegw/sluice/dataplane/internal/classify"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

const (
	classInteractive = configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE
	classAgent       = configv1.TrafficClass_TRAFFIC_CLASS_AGENT
	classBatch       = configv1.TrafficClass_TRAFFIC_CLASS_BATCH
)

// classOf posts one chat and returns the class and reason the proxy
// answered with and recorded on the usage event.
func classOf(t *testing.T, e *env, tok, body string, hdr ...string) (string, string) {
	t.Helper()
	resp := e.post(RouteChat, tok, body, hdr...)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	ev := e.sink.byID(t, resp.Header.Get(openai.RequestIDHeader))
	require.Equal(t, resp.Header.Get(HeaderTrafficClass), ev.TrafficClass)
	require.Equal(t, resp.Header.Get(HeaderClassReason), ev.TrafficClassReason)
	return ev.TrafficClass, ev.TrafficClassReason
}

// TestClassification: the credential's class wins over rules; rules
// classify what the credential leaves open; the org's default applies
// otherwise; both demotion thresholds demote interactive to agent; an
// org whose settings do not compile gets no rules.
func TestClassification(t *testing.T) {
	e := newEnv(t)
	up := &slowUpstream{n: 400, interval: 10 * time.Millisecond}
	e.group("m")
	e.deploy("d1", "m", startUpstream(t, up), nil)
	e.snap.Orgs[0].Traffic = &configv1.OrgTraffic{
		Rules:    []*configv1.ClassificationRule{{Header: "User-Agent", Pattern: "^claude-code/", TrafficClass: classAgent}},
		Demotion: &configv1.Demotion{MaxPromptTokens: 200, MaxInteractiveInFlightPerKey: 1},
	}
	open := e.key("open", nil)
	batch := e.key("batch", func(k *configv1.Key) { k.TrafficClass = classBatch })
	e.apply()
	up.setN(0) // answers at once unless a test sets otherwise

	c, r := classOf(t, e, open, chatBody("m", ""))
	require.Equal(t, []string{"interactive", classify.ReasonDefault}, []string{c, r})
	c, r = classOf(t, e, open, chatBody("m", ""), "User-Agent", "claude-code/1.0")
	require.Equal(t, []string{"agent", "rule:0"}, []string{c, r})
	c, r = classOf(t, e, batch, chatBody("m", ""), "User-Agent", "claude-code/1.0")
	require.Equal(t, []string{"batch", classify.ReasonCredential}, []string{c, r}, "a rule cannot move a credential's class")
	long := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("word ", 400) + `"}],"max_tokens":5}`
	c, r = classOf(t, e, open, long)
	require.Equal(t, []string{"agent", "demoted:prompt_tokens"}, []string{c, r})

	// One interactive request in flight: the key's next is demoted; once
	// it ends the key is interactive again.
	up.setN(400)
	held := e.post(RouteChat, open, chatBody("m", `"stream":true`))
	require.Equal(t, http.StatusOK, held.StatusCode)
	require.Equal(t, "interactive", held.Header.Get(HeaderTrafficClass))
	up.setN(0)
	c, r = classOf(t, e, open, chatBody("m", ""))
	require.Equal(t, []string{"agent", "demoted:in_flight"}, []string{c, r})
	held.Body.Close()
	waitFor(t, "the held request to end", func() bool { return e.h.inFlight.Peek("open") == 0 })
	c, _ = classOf(t, e, open, chatBody("m", ""))
	require.Equal(t, "interactive", c)

	// Settings that do not compile: no rule applies, the org's default
	// (valid) does, and nothing fails.
	e.snap.Orgs[0].Traffic = &configv1.OrgTraffic{DefaultClass: classAgent,
		Rules: []*configv1.ClassificationRule{{Header: "User-Agent", Pattern: "(", TrafficClass: classBatch}}}
	e.apply()
	c, r = classOf(t, e, open, chatBody("m", ""), "User-Agent", "claude-code/1.0")
	require.Equal(t, []string{"agent", classify.ReasonDefault}, []string{c, r})
}

// TestEnginePriority: a priority deployment receives the class's priority,
// an fcfs one none; a client's body priority and X-Vllm-Priority header
// never reach an engine.
func TestEnginePriority(t *testing.T) {
	e := newEnv(t)
	prio := startSim(t, func(c *vllmsim.Config) { c.SchedulingPolicy = vllmsim.PolicyPriority })
	fcfs := startSim(t, nil)
	e.group("p")
	e.group("f")
	e.deploy("dp", "p", prio.URL()+"/v1", func(d *configv1.Deployment) {
		d.Traffic = &configv1.DeploymentTraffic{PriorityScheduling: true, ClassPriority: &configv1.ClassPriorities{Batch: ptr(int32(30))}}
	})
	e.deploy("df", "f", fcfs.URL()+"/v1", nil)
	inter := e.key("inter", func(k *configv1.Key) { k.TrafficClass = classInteractive })
	agent := e.key("agent", func(k *configv1.Key) { k.TrafficClass = classAgent })
	batch := e.key("batch", func(k *configv1.Key) { k.TrafficClass = classBatch })
	e.apply()
	for _, tok := range []string{inter, agent, batch} {
		for _, g := range []string{"p", "f"} {
			resp := e.post(RouteChat, tok, chatBody(g, `"priority":-50`), "X-Vllm-Priority", "-50")
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			require.Equal(t, http.StatusOK, resp.StatusCode, "group %s", g)
		}
	}
	acc := vllmsim.PriorityAccepted
	require.Equal(t, map[vllmsim.PriorityKey]uint64{{Priority: "0", Outcome: acc}: 1, {Priority: "10", Outcome: acc}: 1, {Priority: "30", Outcome: acc}: 1},
		prio.ReceivedPriorities())
	require.Equal(t, map[vllmsim.PriorityKey]uint64{{Priority: vllmsim.PriorityNone, Outcome: acc}: 3}, fcfs.ReceivedPriorities())
}

// parCount counts the live leases of deployment scope id.
func (le *limitsEnv) parCount(id string) int64 {
	ctx := context.Background()
	k := le.prefix + "{o:" + limits.DeploymentOrg("d1") + "}:par:" + limits.KindDeployment + ":" + id
	c, err := le.rdb.ZCount(ctx, k, strconv.FormatInt(time.Now().UnixMilli(), 10), "+inf").Result()
	require.NoError(le.t, err)
	return c
}

// TestReservedSlotsFleetWide: across three proxies sharing the limits
// store, agent and batch together hold at most max_concurrency −
// interactive_reserve slots, batch at most its cap, and interactive
// requests find the reserved slots free.
func TestReservedSlotsFleetWide(t *testing.T) {
	le := newLimitsEnv(t)
	up := &slowUpstream{n: 2000, interval: 10 * time.Millisecond}
	le.group("m")
	le.deploy("d1", "m", startUpstream(t, up), func(d *configv1.Deployment) {
		d.MaxConcurrency = 5
		d.Traffic = &configv1.DeploymentTraffic{InteractiveReserve: 2, BatchMaxConcurrency: 1}
	})
	inter := le.key("inter", func(k *configv1.Key) { k.TrafficClass = classInteractive })
	agent := le.key("agent", func(k *configv1.Key) { k.TrafficClass = classAgent })
	batch := le.key("batch", func(k *configv1.Key) { k.TrafficClass = classBatch })
	le.apply()
	proxies := []*env{le.env}
	for range 2 {
		o := newEnv(t, func(c *Config) { c.Limiter = le.lim })
		o.snap = le.snap
		o.apply()
		proxies = append(proxies, o)
	}
	var held []*http.Response
	defer func() {
		for _, r := range held {
			r.Body.Close()
		}
	}()
	n := 0
	post := func(tok string) int {
		resp := proxies[n%len(proxies)].post(RouteChat, tok, chatBody("m", `"stream":true`))
		n++
		if resp.StatusCode == http.StatusOK {
			held = append(held, resp)
			return 200
		}
		er := readErr(t, resp)
		require.Equal(t, openai.CodeOverloaded, er.Error.Code)
		require.NotEmpty(t, er.Header.Get("Retry-After"))
		return er.Status
	}
	require.Equal(t, 200, post(batch))
	require.Equal(t, 503, post(batch), "batch holds at most its cap")
	require.Equal(t, 200, post(agent))
	require.Equal(t, 200, post(agent))
	require.Equal(t, 503, post(agent), "agent and batch hold at most max_concurrency − interactive_reserve")
	require.Equal(t, 503, post(batch))
	require.Equal(t, 200, post(inter), "the reserve is free for interactive")
	require.Equal(t, 200, post(inter))
	require.Equal(t, 503, post(inter), "max_concurrency holds for every class")
	require.LessOrEqual(t, up.peak.Load(), int64(5))

	// A freed agent slot goes to agents again; the interactive reserve is
	// untouched by it.
	held[1].Body.Close()
	waitFor(t, "the agent slot to be released", func() bool { return le.parCount("d1"+"#shared") == 2 })
	require.Equal(t, 200, post(agent))
	for _, r := range held {
		r.Body.Close()
	}
	held = nil
	waitFor(t, "every lease to be released", func() bool { return up.inFlight.Load() == 0 })
	for _, p := range proxies {
		require.NoError(t, p.h.Drain(context.Background()))
	}
	waitFor(t, "every lease to be released", func() bool { return le.leases() == 0 })
}

// TestAdmissionQueue: across two proxies, a request at its class cap
// waits instead of an immediate 503 and gets the slot another proxy
// frees; a waiter is shed at its timeout with 503 overloaded and a
// retry-after; a full queue sheds at once; shed requests consume no rate
// limit; /health/backlog counts them.
func TestAdmissionQueue(t *testing.T) {
	bounds := admission.Bounds{{MaxLength: 4, Timeout: 5 * time.Second}, {MaxLength: 1, Timeout: 300 * time.Millisecond}, {}}
	withQueues := func(c *Config) { c.AdmissionQueues = bounds; c.AdmissionRetryInterval = 20 * time.Millisecond }
	le := newLimitsEnv(t, withQueues)
	up := &slowUpstream{n: 2000, interval: 10 * time.Millisecond}
	le.group("m")
	le.deploy("d1", "m", startUpstream(t, up), func(d *configv1.Deployment) {
		d.MaxConcurrency = 2
		d.Traffic = &configv1.DeploymentTraffic{InteractiveReserve: 1}
	})
	inter := le.key("inter", func(k *configv1.Key) { k.TrafficClass = classInteractive })
	agent := le.key("agent", func(k *configv1.Key) {
		k.TrafficClass = classAgent
		// A tpm limit too: an rpm-only admission writes no record to refund
		// (docs/traffic.md, "Shed requests").
		k.Limits = &configv1.Limits{RpmLimit: ptr(int64(4)), TpmLimit: ptr(int64(1_000_000))}
	})
	le.apply()
	other := newEnv(t, func(c *Config) { c.Limiter = le.lim; withQueues(c) })
	other.snap = le.snap
	other.apply()

	a1 := le.post(RouteChat, agent, chatBody("m", `"stream":true`))
	require.Equal(t, 200, a1.StatusCode)
	i1 := le.post(RouteChat, inter, chatBody("m", `"stream":true`))
	require.Equal(t, 200, i1.StatusCode)

	// An agent waits for its share: shed at its timeout, not before.
	t0 := time.Now()
	er := readErr(t, other.post(RouteChat, agent, chatBody("m", "")))
	took := time.Since(t0)
	t.Logf("agent shed at its 300ms queue timeout after %s, retry-after-ms %s", took, er.Header.Get("Retry-After-Ms"))
	require.Equal(t, 503, er.Status)
	require.Equal(t, openai.CodeOverloaded, er.Error.Code)
	require.Contains(t, er.Error.Message, "queue timeout")
	require.NotEmpty(t, er.Header.Get("Retry-After-Ms"))
	require.GreaterOrEqual(t, took, 300*time.Millisecond)
	require.Less(t, took, 300*time.Millisecond+time.Second, "shed at its timeout")

	// A full agent queue sheds at once.
	held := make(chan *http.Response, 1)
	go func() { held <- other.post(RouteChat, agent, chatBody("m", "")) }()
	waitFor(t, "an agent queued", func() bool { return other.h.queues.Backlog().Classes["agent"].Queued == 1 })
	er = readErr(t, other.post(RouteChat, agent, chatBody("m", "")))
	require.Equal(t, 503, er.Status)
	require.Contains(t, er.Error.Message, "queue is full")
	er = readErr(t, <-held)
	require.Equal(t, openai.CodeOverloaded, er.Error.Code)

	// An interactive request waits for the slot the other proxy frees.
	got := make(chan *http.Response, 1)
	go func() { got <- other.post(RouteChat, inter, chatBody("m", "")) }()
	waitFor(t, "an interactive request queued", func() bool { return other.h.queues.Backlog().Classes["interactive"].Queued == 1 })
	i1.Body.Close()
	tw := time.Now()
	resp := <-got
	t.Logf("queued interactive request on the other proxy got the freed slot %s after the release", time.Since(tw))
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, 200, resp.StatusCode, "woken by the freed slot")

	// Three agent requests were shed: none used the key's rpm of 4 (a1
	// used one; three more pass once the slot is free).
	a1.Body.Close()
	waitFor(t, "the agent slot to be released", func() bool { return le.parCount("d1"+admission.SharedSuffix) == 0 })
	waitFor(t, "the shed requests to finish", func() bool {
		n := 0
		for _, ev := range other.sink.events() {
			if ev.ErrorCode == openai.CodeOverloaded {
				n++
			}
		}
		return n == 3
	})
	require.NoError(t, other.h.Drain(context.Background())) // the cancellations are applied
	for i := range 3 {
		resp := le.post(RouteChat, agent, chatBody("m", ""))
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, 200, resp.StatusCode, "request %d: %s", i, b)
	}
	up.setN(0)
	bl := other.h.queues.Backlog()
	require.Equal(t, uint64(3), bl.Classes["agent"].Rejected)
	r, err := http.Get(other.srv.URL + "/health/backlog")
	require.NoError(t, err)
	b, _ := io.ReadAll(r.Body)
	r.Body.Close()
	require.Contains(t, string(b), `"agent":{"in_flight":0,"queued":0,"rejected":3}`)
	require.NotContains(t, string(b), "o1")
	// The heartbeat carries the same figures, one entry per class in
	// priority order.
	hb := other.h.AdmissionBacklog()
	require.Len(t, hb, 3)
	require.Equal(t, []string{"interactive", "agent", "batch"}, []string{hb[0].TrafficClass, hb[1].TrafficClass, hb[2].TrafficClass})
	require.Equal(t, uint64(3), hb[1].Shed)
	require.Zero(t, hb[1].Queued)
}

// TestFairShareBetweenTeams: two agent teams on one engine, both
// backlogged, team "big" sending 10× the requests with 4× longer prompts:
// the token cost served to each (prompt + 2 × completion tokens, from the
// engine's usage) stays within 1.25 of the other, while the engine's slots
// stay busy.
func TestFairShareBetweenTeams(t *testing.T) {
	le := newLimitsEnv(t, func(c *Config) {
		c.AdmissionQueues, c.AdmissionRetryInterval = admission.DefaultBounds, 20*time.Millisecond
	})
	sim := startSim(t, func(c *vllmsim.Config) { c.TimeScale, c.IgnoreEOS = 1, true })
	const slots = 2
	le.group("m")
	le.deploy("d1", "m", sim.URL()+"/v1", func(d *configv1.Deployment) { d.MaxConcurrency = slots })
	le.snap.Teams = append(le.snap.Teams, &configv1.Team{Id: "t2", OrgId: "o1"})
	le.snap.Members = append(le.snap.Members, &configv1.Member{TeamId: "t2", UserId: "u1", OrgId: "o1"})
	big := le.key("big", func(k *configv1.Key) { k.TrafficClass = classAgent })
	small := le.key("small", func(k *configv1.Key) { k.TrafficClass, k.TeamId = classAgent, "t2" })
	le.apply()

	body := func(words int) string {
		return `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("lorem ", words) + `"}],"max_tokens":30}`
	}
	type done struct {
		team string
		cost float64
		at   time.Time
	}
	var mu sync.Mutex
	var served []done
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	worker := func(tok, team, b string) {
		defer wg.Done()
		for ctx.Err() == nil {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, le.srv.URL+RouteChat, strings.NewReader(b))
			req.Header.Set("Authorization", "Bearer "+tok)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				continue
			}
			var out struct {
				Usage openai.Usage `json:"usage"`
			}
			err = json.NewDecoder(resp.Body).Decode(&out)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusOK {
				continue
			}
			mu.Lock()
			served = append(served, done{team, admission.Cost(out.Usage.PromptTokens, out.Usage.CompletionTokens), time.Now()})
			mu.Unlock()
		}
	}
	// 40 loops of 800-word prompts against 4 of 200 words: 10× the
	// requests, 4× the prompt; both teams always have a waiter (the small
	// team's fair share is under 2 slots).
	for range 40 {
		wg.Add(1)
		go worker(big, "t1", body(800))
	}
	for range 4 {
		wg.Add(1)
		go worker(small, "t2", body(200))
	}
	waitFor(t, "both teams backlogged", func() bool { return le.h.queues.Backlog().Classes["agent"].Queued >= 40 })
	from := time.Now().Add(time.Second)
	to := from.Add(8 * time.Second)
	var samples, full int
	for time.Now().Before(to) {
		if time.Now().After(from) {
			samples++
			if sim.Stats().NumRunning == slots {
				full++
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	cost := map[string]float64{}
	n := map[string]int{}
	for _, d := range served {
		if d.at.After(from) && d.at.Before(to) {
			cost[d.team] += d.cost
			n[d.team]++
		}
	}
	a, b := cost["t1"], cost["t2"]
	require.Positive(t, a)
	require.Positive(t, b)
	ratio := max(a, b) / min(a, b)
	jain := (a + b) * (a + b) / (2 * (a*a + b*b))
	busy := float64(full) / float64(samples)
	t.Logf("served cost: big %.0f (%d requests), small %.0f (%d requests): ratio %.3f, Jain index %.4f; engine slots all busy in %.1f%% of samples",
		a, n["t1"], b, n["t2"], ratio, jain, 100*busy)
	require.LessOrEqual(t, ratio, 1.25)
	require.Greater(t, busy, 0.5, "the engine stays busy")
}
