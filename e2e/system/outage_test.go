package system

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sluicegw/sluice/dataplane"

	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// startProxyPolicy is startProxy with a stale policy.
func (d *dist) startProxyPolicy(region string, maxStale time.Duration, policy string) *proxy {
	d.T.Helper()
	return d.StartProxyConfig(dataplane.Config{Region: region, NATSURL: d.NATS.URL, Addr: "127.0.0.1:0", KeyPepper: testPepper, KEK: testKEK, RedisKeyPrefix: d.RedisPrefix,
		MaxStaleness: maxStale, StalePolicy: policy, HeartbeatInterval: 200 * time.Millisecond,
		// A deployment at its cap answers 503 at once, as these tests
		// expect (admission queues: docs/traffic.md).
		AdmissionQueues: "interactive=0/1s,agent=0/1s,batch=0/1s"})
}

// get returns the status and body of GET url.
func get(t testing.TB, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// metric returns the value of an unlabelled metric on p's /metrics.
func metric(t testing.TB, p *proxy, name string) string {
	t.Helper()
	_, body := get(t, p.URL+"/metrics")
	for line := range strings.Lines(body) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+" "); ok {
			return v
		}
	}
	t.Fatalf("metric %s not on %s/metrics", name, p.URL)
	return ""
}

// staleTest is the common part of the outage tests: a tenant, two data
// planes with policy and maxStale, all serving the tenant's key.
func staleTest(t *testing.T, maxStale time.Duration, policy string) (*dist, tenant, []*proxy) {
	d := startDist(t)
	ten := d.NewTenant("acme")
	ps := []*proxy{d.startProxyPolicy("default", maxStale, policy), d.startProxyPolicy("default", maxStale, policy)}
	for _, p := range ps {
		harness.WaitStatus(t, p, ten.Token, http.StatusOK, 5*time.Second)
		require.Equal(t, "0", metric(t, p, "sluice_dataplane_stale"))
	}
	return d, ten, ps
}

// TestNATSDownStaleness stops NATS under running data planes (reject
// policy): they serve on their last configuration for max staleness, then
// refuse with 503 stale_config within 2 s more and say so in /readyz and
// metrics. A block issued during the outage waits in the control plane's
// outbox; when NATS returns the data planes resync and enforce it.
func TestNATSDownStaleness(t *testing.T) {
	t.Parallel()
	const (
		maxStale = 3 * time.Second
		late     = 2 * time.Second
	)
	d, ten, ps := staleTest(t, maxStale, dataplane.StalePolicyReject)
	c := d.Clients()

	d.NATS.Stop()
	stopped := time.Now()
	// The last contact (a tick, every 200 ms) came a little before the
	// stop: the staleness clock started then.
	sinceContact := make([]time.Duration, len(ps))
	for i, p := range ps {
		sinceContact[i] = p.DP.Staleness()
		require.Less(t, sinceContact[i], time.Second, "proxy %d was not hearing ticks", i)
	}
	firstStale := make([]time.Duration, len(ps))
	served := make([]int, len(ps))
	for done := 0; done < len(ps); {
		require.Less(t, time.Since(stopped), maxStale+late+time.Second, "data planes kept serving")
		for i, p := range ps {
			if firstStale[i] != 0 {
				continue
			}
			status, code := harness.Check(t, p, ten.Token)
			switch {
			case status == http.StatusOK:
				served[i]++
			case status == http.StatusServiceUnavailable && code == "stale_config":
				firstStale[i] = time.Since(stopped)
				done++
			default:
				t.Fatalf("proxy %d answered %d (%s) %s after NATS stopped", i, status, code, time.Since(stopped))
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	for i, p := range ps {
		t.Logf("proxy %d: served %d checks, first stale_config %s after NATS stopped, %s after the last contact (max staleness %s)",
			i, served[i], firstStale[i], firstStale[i]+sinceContact[i], maxStale)
		require.GreaterOrEqual(t, firstStale[i], maxStale-sinceContact[i], "proxy %d refused too early", i)
		require.LessOrEqual(t, firstStale[i], maxStale+late, "proxy %d refused too late", i)
		status, body := get(t, p.URL+"/readyz")
		require.Equal(t, http.StatusServiceUnavailable, status)
		require.Contains(t, body, "stale")
		require.Equal(t, "1", metric(t, p, "sluice_dataplane_stale"))
		require.NotEqual(t, "0", metric(t, p, "sluice_dataplane_stale_rejections_total"))
	}

	// A revocation during the outage: Postgres takes it, the outbox holds
	// it until NATS returns.
	_, err := c.Key.BlockKey(context.Background(), connect.NewRequest(&adminv1.BlockKeyRequest{Id: ten.KeyID}))
	require.NoError(t, err)

	d.NATS.Start()
	restarted := time.Now()
	for i, p := range ps {
		var serving, blocked time.Duration
		var leaked int // 200s after the restart: the block not yet applied
		for blocked == 0 {
			require.Less(t, time.Since(restarted), 5*time.Second, "proxy %d did not resync and enforce the block", i)
			status, code := harness.Check(t, p, ten.Token)
			if status != http.StatusServiceUnavailable && serving == 0 {
				serving = time.Since(restarted)
			}
			switch {
			case status == http.StatusForbidden:
				require.Equal(t, "key_blocked", code)
				blocked = time.Since(restarted)
			case status == http.StatusOK:
				leaked++
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Logf("proxy %d: serving again %s and key_blocked %s after NATS restarted (%d checks answered 200 in between)", i, serving, blocked, leaked)
		require.LessOrEqual(t, serving, 5*time.Second)
		require.LessOrEqual(t, blocked, time.Second, "proxy %d: the block took effect %s after reconnect", i, blocked)
	}
	for _, p := range ps {
		harness.Eventually(t, func() bool {
			status, _ := get(t, p.URL+"/readyz")
			return status == http.StatusOK && metric(t, p, "sluice_dataplane_stale") == "0"
		}, 5*time.Second, 20*time.Millisecond)
	}
}

// TestStalePolicyServe: with the serve policy a data plane keeps serving
// past max staleness, reporting the staleness in /readyz and metrics.
func TestStalePolicyServe(t *testing.T) {
	t.Parallel()
	const maxStale = time.Second
	d, ten, ps := staleTest(t, maxStale, dataplane.StalePolicyServe)

	d.NATS.Stop()
	stopped := time.Now()
	for _, p := range ps {
		harness.Eventually(t, func() bool { return metric(t, p, "sluice_dataplane_stale") == "1" }, maxStale+2*time.Second, 20*time.Millisecond)
		status, body := get(t, p.URL+"/readyz")
		require.Equal(t, http.StatusServiceUnavailable, status)
		require.Contains(t, body, "stale")
	}
	// Past max staleness, and for a while longer, every check is served.
	for time.Since(stopped) < 2*maxStale {
		for _, p := range ps {
			status, code := harness.Check(t, p, ten.Token)
			require.Equal(t, http.StatusOK, status, "%s after NATS stopped: %s", time.Since(stopped), code)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, p := range ps {
		require.Equal(t, "1", metric(t, p, "sluice_dataplane_stale"))
		require.Equal(t, "0", metric(t, p, "sluice_dataplane_stale_rejections_total"))
	}

	d.NATS.Start()
	for _, p := range ps {
		harness.Eventually(t, func() bool {
			status, _ := get(t, p.URL+"/readyz")
			return status == http.StatusOK && metric(t, p, "sluice_dataplane_stale") == "0"
		}, 5*time.Second, 20*time.Millisecond)
	}
}
