package system

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
)

// TestReadyzLimitsStore: with its limits store (a redis-server of its own)
// stopped, the proxy's /readyz answers 503 naming the store within 1 s;
// with the store back, 200.
func TestReadyzLimitsStore(t *testing.T) {
	t.Parallel()
	lfQuietRedisLog()
	d := startDist(t)
	rs := lfStartRedis(t)
	p := d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.RedisURL = rs.url() })

	status, body := get(t, p.URL+"/readyz")
	require.Equal(t, http.StatusOK, status, body)

	for round := range 2 {
		gone := rs.kill()
		var last string
		require.Eventually(t, func() bool {
			var st int
			st, last = get(t, p.URL+"/readyz")
			return st == http.StatusServiceUnavailable
		}, time.Second, 10*time.Millisecond, "round %d: /readyz not 503 within 1 s of Redis dying (last: %q)", round, last)
		took := time.Since(gone)
		require.Contains(t, last, "limits store (Redis) unreachable")
		t.Logf("round %d: /readyz 503 %s after Redis died: %s", round, took.Round(time.Millisecond), strings.TrimSpace(last))

		rs.start()
		back := time.Now()
		require.Eventually(t, func() bool {
			st, _ := get(t, p.URL+"/readyz")
			return st == http.StatusOK
		}, time.Second, 10*time.Millisecond, "round %d: /readyz not 200 within 1 s of Redis returning", round)
		t.Logf("round %d: /readyz 200 %s after Redis returned", round, time.Since(back).Round(time.Millisecond))
	}

	// A frozen Redis (connections accepted, nothing answered) is caught by
	// the probe's timeout.
	frozen := rs.stop()
	require.Eventually(t, func() bool {
		st, _ := get(t, p.URL+"/readyz")
		return st == http.StatusServiceUnavailable
	}, time.Second, 10*time.Millisecond, "/readyz not 503 within 1 s of Redis freezing")
	t.Logf("frozen: /readyz 503 %s after Redis froze", time.Since(frozen).Round(time.Millisecond))
	rs.cont()
	require.Eventually(t, func() bool {
		st, _ := get(t, p.URL+"/readyz")
		return st == http.StatusOK
	}, time.Second, 10*time.Millisecond, "/readyz not 200 within 1 s of Redis resuming")
}
