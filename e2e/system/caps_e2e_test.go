package system

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// classProbe counts, in front of an engine, the requests in flight by the
// engine priority the proxies set (agent 10, batch 20 by default) and
// their peaks.
type classProbe struct {
	agents, batch, shared         atomic.Int64
	peakAgents, peakBatch, peakAB atomic.Int64
}

func raise(peak *atomic.Int64, n int64) {
	for {
		p := peak.Load()
		if n <= p || peak.CompareAndSwap(p, n) {
			return
		}
	}
}

func (c *classProbe) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(body))
		var p struct {
			Priority *int `json:"priority"`
		}
		_ = json.Unmarshal(body, &p)
		if p.Priority != nil && (*p.Priority == 10 || *p.Priority == 20) {
			own := &c.agents
			peak := &c.peakAgents
			if *p.Priority == 20 {
				own, peak = &c.batch, &c.peakBatch
			}
			raise(peak, own.Add(1))
			raise(&c.peakAB, c.shared.Add(1))
			defer func() { own.Add(-1); c.shared.Add(-1) }()
		}
		next.ServeHTTP(w, r)
	})
}

// TestClassCapsHoldUnderLoad: issue 12, "Caps hold fleet-wide". One engine
// (max_num_seqs 4, priority scheduling) of a deployment with
// max_concurrency 4, interactive_reserve 2 and batch_max_concurrency 1,
// behind 3 proxies; 2 agent closed loops of one org and 10 batch loops of
// another (more than the caps) spread over the proxies, and a chat every 100 ms. The engine never
// sees more than 2 agent+batch requests in flight, nor more than 1 batch;
// every chat is served, and none waited in an admission queue: it always
// found a reserved slot.
func TestClassCapsHoldUnderLoad(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ctx := context.Background()
	var proxies []*proxy
	for range 3 {
		proxies = append(proxies, d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.LimitsCallTimeout = 2 * time.Second }))
	}
	cfg := vllmsim.DefaultConfig()
	cfg.Addr, cfg.TimeScale, cfg.IgnoreEOS, cfg.MaxNumSeqs = "127.0.0.1:0", 1, true, 4
	cfg.SchedulingPolicy = vllmsim.PolicyPriority
	sim, err := vllmsim.New(cfg, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	ectx, stopEngine := context.WithCancel(ctx)
	engineDone := make(chan struct{})
	go func() { defer close(engineDone); _ = sim.RunEngine(ectx) }()
	probe := &classProbe{}
	srv := httptest.NewServer(probe.wrap(sim.Handler()))
	t.Cleanup(func() { srv.CloseClientConnections(); stopEngine(); <-engineDone; srv.Close() })

	m := d.modelClient()
	_, err = m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "caps", PlatformWide: true}))
	require.NoError(t, err)
	dep, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "caps", ApiBase: srv.URL + "/v1",
		UpstreamModel: vllmsim.DefaultModel, Weight: 1, MaxConcurrency: 4, Prices: &adminv1.Prices{InputPerToken: 1e-9, OutputPerToken: 3e-9}}))
	require.NoError(t, err)
	tr := adminv1connect.NewTrafficServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(testBootstrap)))
	_, err = tr.SetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.SetDeploymentTrafficRequest{DeploymentId: dep.Msg.Deployment.Id,
		Traffic: &adminv1.DeploymentTraffic{InteractiveReserve: 2, BatchMaxConcurrency: 1, PriorityScheduling: true}}))
	require.NoError(t, err)
	ten := d.NewTenant("caps")
	other := d.NewTenant("caps-other") // the batch loops' org: the caps are the deployment's, across orgs
	key := func(c adminv1.TrafficClass) string {
		ten := ten
		if c == adminv1.TrafficClass_TRAFFIC_CLASS_BATCH {
			ten = other
		}
		k, err := d.Clients().Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID, UserId: ten.UserID, TrafficClass: c}))
		require.NoError(t, err)
		return k.Msg.Token
	}
	chatTok, agentTok, batchTok := key(adminv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE), key(adminv1.TrafficClass_TRAFFIC_CLASS_AGENT), key(adminv1.TrafficClass_TRAFFIC_CLASS_BATCH)
	for _, p := range proxies {
		harness.Eventually(t, func() bool {
			ds := p.DP.Catalog().Deployments("caps")
			return len(ds) == 1 && ds[0].GetTraffic().GetBatchMaxConcurrency() == 1 && ds[0].GetTraffic().GetPriorityScheduling()
		}, 15*time.Second, 10*time.Millisecond)
		for _, tok := range []string{chatTok, agentTok, batchTok} {
			harness.WaitStatus(t, p, tok, http.StatusOK, 15*time.Second)
		}
	}
	post := func(ctx context.Context, url, tok string, maxTokens int) (*http.Response, error) {
		body := fmt.Sprintf(`{"model":"caps","max_tokens":%d,"messages":[{"role":"user","content":"hello"}]}`, maxTokens)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+tok)
		return http.DefaultClient.Do(req)
	}
	// New deployments' lease counts are in quarantine for their first
	// moments (limits_recovering): a chat passes on every proxy first.
	harness.Eventually(t, func() bool {
		for _, p := range proxies {
			resp, err := post(ctx, p.URL, chatTok, 2)
			if err != nil {
				return false
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return false
			}
		}
		return true
	}, 30*time.Second, 50*time.Millisecond, "a chat passes on every proxy")

	lctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var served atomic.Int64
	var lastErr atomic.Pointer[string] // the first refusal of a loop, for the log
	loop := func(url, tok string) {
		defer wg.Done()
		for lctx.Err() == nil {
			resp, err := post(lctx, url, tok, 30)
			if err != nil {
				continue
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				served.Add(1)
			} else if lastErr.Load() == nil {
				e := fmt.Sprintf("%d %s", resp.StatusCode, b)
				lastErr.Store(&e)
			}
		}
	}
	// Two agent loops (more would keep the agent queue non-empty, and
	// strict priority would then never let a batch request in) and ten
	// batch loops: the shared cap binds agents and batch together, the
	// batch cap binds batch.
	for i := range 12 {
		wg.Add(1)
		tok := batchTok
		if i < 2 {
			tok = agentTok
		}
		go loop(proxies[i%3].URL, tok)
	}
	defer func() { cancel(); wg.Wait() }()
	harness.Eventually(t, func() bool { return probe.peakAB.Load() >= 2 && probe.peakBatch.Load() >= 1 }, 15*time.Second, 5*time.Millisecond,
		"agents and batch fill their share (served %d, peaks %d/%d, first refusal %v)", served.Load(), probe.peakAB.Load(), probe.peakBatch.Load(), lastErr.Load())

	var chats []int
	var chatClass []string
	pace := time.NewTicker(100 * time.Millisecond) // a chat every 100 ms
	defer pace.Stop()
	for i := range 40 {
		<-pace.C
		resp, err := post(ctx, proxies[i%3].URL, chatTok, 3)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		chats = append(chats, resp.StatusCode)
		chatClass = append(chatClass, resp.Header.Get("X-Sluice-Traffic-Class"))
	}
	cancel()
	wg.Wait()

	// No chat waited in a queue: the interactive "queued" admissions of
	// every proxy are 0.
	var queuedChats float64
	for _, p := range proxies {
		resp, err := http.Get(p.URL + "/metrics")
		require.NoError(t, err)
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if strings.HasPrefix(line, "sluice_admission_admitted_total{") && strings.Contains(line, `class="interactive"`) {
				f := strings.Fields(line)
				v, _ := strconv.ParseFloat(f[len(f)-1], 64)
				queuedChats += v
			}
		}
		resp.Body.Close()
	}
	t.Logf("engine peaks: agent+batch %d (cap 2), batch %d (cap 1), agent %d; agent/batch answers %d; chats %v",
		probe.peakAB.Load(), probe.peakBatch.Load(), probe.peakAgents.Load(), served.Load(), chats)
	require.Positive(t, served.Load())
	require.LessOrEqual(t, probe.peakAB.Load(), int64(2), "agent+batch above max_concurrency − interactive_reserve at the engine")
	require.LessOrEqual(t, probe.peakBatch.Load(), int64(1), "batch above its cap at the engine")
	for i, st := range chats {
		require.Equal(t, http.StatusOK, st, "chat %d", i)
		require.Equal(t, "interactive", chatClass[i], "chat %d", i)
	}
	require.Zero(t, queuedChats, "a chat waited in the admission queue for a slot")
}
