package system

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// TestDeadlineAcrossFallbacks: the total deadline holds across TTFT
// retries and fallback groups. Every engine stalls (nothing within 5 s);
// the primary group's TTFT deadline (200 ms) abandons its attempts and
// moves on (primary, primary, fallback), and the request ends at its
// total deadline (700 ms) with a typed 504. Latency is measured from the
// client under concurrent load; the bound is deadline + 50 ms,
// asserted here with a margin for -race on a loaded machine and logged.
func TestDeadlineAcrossFallbacks(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ctx := context.Background()
	m := d.modelClient()
	stall := func() *vllmsim.Server {
		cfg := vllmsim.DefaultConfig()
		cfg.Addr, cfg.TimeScale = "127.0.0.1:0", 20
		cfg.Faults.Delay = 5 * time.Second
		return harness.StartSim(t, cfg)
	}
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "fb-slow", PlatformWide: true}))
	require.NoError(t, err)
	_, err = m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "slow", PlatformWide: true, Fallbacks: []string{"fb-slow"},
		Resilience: &adminv1.ModelGroupResilience{TtftTimeoutMs: 200, MaxAttempts: 4}}))
	require.NoError(t, err)
	createDeployment(t, d, "slow", stall().URL()+"/v1", 1)
	createDeployment(t, d, "slow", stall().URL()+"/v1", 1)
	createDeployment(t, d, "fb-slow", stall().URL()+"/v1", 1)
	ten := d.NewTenant("deadline")
	const deadline = 700 * time.Millisecond
	p := d.StartProxy("default", time.Minute, func(c *dataplane.Config) {
		c.RequestTimeout, c.RetryBudgetMin, c.HealthCheckInterval = deadline, 1000, time.Hour
	})
	harness.Eventually(t, func() bool {
		return len(p.DP.Catalog().Deployments("fb-slow")) == 1 && len(p.DP.Catalog().Deployments("slow")) == 2
	},
		10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, 10*time.Second)

	const n, workers = 24, 6
	var mu sync.Mutex
	var worst time.Duration
	var attempts []string
	var wg sync.WaitGroup
	next := make(chan int, n)
	for i := range n {
		next <- i
	}
	close(next)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				body := `{"model":"slow","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true}`
				if i%2 == 1 {
					body = `{"model":"slow","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`
				}
				req, _ := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(body))
				req.Header.Set("Authorization", "Bearer "+ten.Token)
				start := time.Now()
				resp, err := http.DefaultClient.Do(req)
				require.NoError(t, err)
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				took := time.Since(start)
				require.Equal(t, http.StatusGatewayTimeout, resp.StatusCode, "%s", b)
				require.Contains(t, string(b), `"code":"upstream_timeout"`)
				mu.Lock()
				worst = max(worst, took)
				if i%2 == 0 {
					attempts = append(attempts, resp.Header.Get(dataplane.HeaderAttempts)+"@"+resp.Header.Get(dataplane.HeaderModelGroup))
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	t.Logf("%d requests (streams: TTFT retries then the fallback group; non-streams: one attempt) at deadline %s: worst latency %s (+%s); stream attempts %v",
		n, deadline, worst, worst-deadline, attempts)
	for _, a := range attempts {
		require.Equal(t, "3@fb-slow", a, "two TTFT-abandoned attempts on the primary, the third on the fallback, cut by the deadline")
	}
	require.LessOrEqual(t, worst, deadline+250*time.Millisecond, "the total deadline across retries and fallbacks")
}
