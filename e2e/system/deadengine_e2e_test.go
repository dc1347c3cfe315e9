package system

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// deadAddr is an address nothing listens on (connection refused).
func deadAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

func createDeployment(t testing.TB, d *dist, group, apiBase string, weight int32) string {
	t.Helper()
	r, err := d.modelClient().CreateDeployment(context.Background(), connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: group, ApiBase: apiBase,
		UpstreamModel: vllmsim.DefaultModel, Weight: weight, Prices: &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 3e-6}}))
	require.NoError(t, err)
	return r.Msg.GetDeployment().GetId()
}

// TestDeadEngine: an engine that refuses connections is ejected within 5
// failures (and well within a second of its first); an engine process
// SIGKILLed while it streams ends every in-flight stream with a typed
// error event, and nothing is retried after bytes reached the client.
func TestDeadEngine(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ctx := context.Background()
	// The group's own ejection backoff (10 s) replaces the proxy's 1 s,
	// long enough to see the ejection in the fleet view.
	_, err := d.modelClient().CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "dead", PlatformWide: true,
		Resilience: &adminv1.ModelGroupResilience{EjectionBaseMs: 10000, EjectionMaxMs: 20000}}))
	require.NoError(t, err)
	live := harness.StartSim(t, func() vllmsim.Config {
		c := vllmsim.DefaultConfig()
		c.Addr, c.TimeScale, c.MeanOutputTokens = "127.0.0.1:0", 20, 4
		return c
	}())
	liveID := createDeployment(t, d, "dead", live.URL()+"/v1", 1)
	refusedID := createDeployment(t, d, "dead", "http://"+deadAddr(t)+"/v1", 1000)
	// The engine process to kill, streaming slowly (a token every ~50 ms).
	bin := goBuild(t, t.TempDir(), "./cmd/vllm-sim", "vllm-sim")
	port := freePort(t)
	cmd := exec.Command(bin, "--host", "127.0.0.1", "--port", fmt.Sprint(port), "--time-scale", "1",
		"--decode-step-base", "50ms", "--ignore-eos", "--log-level", "error")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	procURL := fmt.Sprintf("http://127.0.0.1:%d", port)
	harness.Eventually(t, func() bool {
		resp, err := http.Get(procURL + "/health")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil && resp.StatusCode == http.StatusOK
	}, 30*time.Second, 20*time.Millisecond, "the engine process never came up")

	ten := d.NewTenant("deadengine")
	p := d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.RetryBudgetMin = 1000; c.HealthCheckInterval = time.Hour })
	harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("dead")) == 2 }, 10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, 10*time.Second)
	g := p.DP.Gatherer()
	refusals := func() float64 {
		return promValue(t, g, "sluice_proxy_upstream_errors_total", map[string]string{"deployment": refusedID, "kind": "refused"})
	}
	ejections := func(id string) float64 {
		return promValue(t, g, "sluice_proxy_deployment_ejections_total", map[string]string{"deployment": id, "reason": "failures"})
	}

	// Connection refused: requests succeed on the live engine while the
	// dead one is ejected.
	post := func(body string) *http.Response {
		req, _ := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+ten.Token)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		return resp
	}
	short := `{"model":"dead","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`
	var first time.Time
	var failuresAtEjection float64
	var ejectedAfter time.Duration
	for i := 0; i < 50 && ejections(refusedID) == 0; i++ {
		resp := post(short)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, "a retry on the live engine serves it")
		if first.IsZero() && refusals() > 0 {
			first = time.Now()
		}
		if ejections(refusedID) > 0 {
			failuresAtEjection, ejectedAfter = refusals(), time.Since(first)
		}
	}
	require.Equal(t, float64(1), ejections(refusedID), "the refusing engine was never ejected")
	require.LessOrEqual(t, failuresAtEjection, float64(5))
	t.Logf("connection refused: ejected after %.0f failures, %s after the first", failuresAtEjection, ejectedAfter)
	require.Less(t, ejectedAfter, time.Second)

	// The fleet view shows the ejection (the heartbeat carries it), and so
	// do the metrics; the group's 10 s backoff keeps it out meanwhile.
	var seen *adminv1.EjectedDeployment
	harness.Eventually(t, func() bool {
		r, err := d.Clients().Fleet.ListDataPlanes(ctx, connect.NewRequest(&adminv1.ListDataPlanesRequest{}))
		require.NoError(t, err)
		for _, dp := range r.Msg.GetDataPlanes() {
			for _, e := range dp.GetEjectedDeployments() {
				if e.GetDeploymentId() == refusedID {
					seen = e
				}
			}
		}
		return seen != nil
	}, 5*time.Second, 50*time.Millisecond, "the fleet view never showed the ejected deployment")
	require.Equal(t, "ejected", seen.GetReason())
	require.Equal(t, "dead", seen.GetModelGroup())
	require.WithinDuration(t, time.Now().Add(10*time.Second), seen.GetUntil().AsTime(), 5*time.Second, "the group's ejection backoff")
	require.Equal(t, float64(1), promValue(t, g, "sluice_proxy_deployments_out", map[string]string{"model_group": "dead", "reason": "ejected"}))

	// The engine process: moved into the group, the refusing one out.
	procID := createDeployment(t, d, "dead", procURL+"/v1", 1000)
	_, err = d.modelClient().DeleteDeployment(ctx, connect.NewRequest(&adminv1.DeleteDeploymentRequest{Id: refusedID}))
	require.NoError(t, err)
	harness.Eventually(t, func() bool {
		ds := p.DP.Catalog().Deployments("dead")
		return len(ds) == 2 && (ds[0].GetId() == procID || ds[1].GetId() == procID)
	}, 10*time.Second, 10*time.Millisecond)

	const streams = 6
	type result struct {
		chunks   int
		lastData string
	}
	results := make([]result, streams)
	started := make(chan struct{}, streams)
	var wg sync.WaitGroup
	for i := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp := post(`{"model":"dead","messages":[{"role":"user","content":"tell me a long story"}],"max_tokens":2000,"stream":true}`)
			defer resp.Body.Close()
			sc := bufio.NewScanner(resp.Body)
			signalled := false
			for sc.Scan() {
				v, ok := strings.CutPrefix(sc.Text(), "data: ")
				if !ok {
					continue
				}
				results[i].chunks++
				results[i].lastData = v
				if !signalled {
					signalled = true
					started <- struct{}{}
				}
			}
			if !signalled {
				started <- struct{}{}
			}
		}()
	}
	for range streams {
		<-started
	}
	liveBefore := received(live)
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	wg.Wait()
	cut := 0
	for _, r := range results {
		if r.lastData == "[DONE]" {
			continue // served by the live engine
		}
		cut++
		require.Contains(t, r.lastData, `"error"`, "a stream cut by the kill ends with an error event")
		require.Contains(t, r.lastData, `"code":"upstream_`, "typed: %s", r.lastData)
	}
	require.Positive(t, cut, "no stream was on the killed engine")
	require.Equal(t, liveBefore, received(live), "a stream was retried after bytes reached the client")
	t.Logf("SIGKILL: %d of %d streams were on the killed engine and ended with a typed error event", cut, streams)

	// The killed engine (now connection refused) is out within 5 failures:
	// the cuts count, then refusals.
	for i := 0; i < 20 && ejections(procID) == 0; i++ {
		resp := post(short)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	require.Positive(t, ejections(procID), "the killed engine was never ejected")
	fails := promValue(t, g, "sluice_proxy_upstream_errors_total", map[string]string{"deployment": procID, "kind": "refused"})
	require.LessOrEqual(t, fails, float64(5))
	_ = liveID
}
