package limits

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// BenchmarkScripts measures what the scripts cost Redis: one admission and
// one settlement of a request limited at key, team and org level (rpm,
// tpm, parallel and budget each), sequentially, reporting Redis's own
// execution time per EVALSHA (INFO commandstats) and per request. The rate
// window is scaled down (61 buckets of 10 ms) so that windows are full, as
// under steady traffic, within the warm-up.
//
//	go test -run '^$' -bench BenchmarkScripts -benchtime 5000x ./dataplane/internal/limits/
func BenchmarkScripts(b *testing.B) {
	bd := setup(b, func(c *Config) { c.rateWindow, c.rateBucket = 600*time.Millisecond, 10*time.Millisecond })
	ctx := context.Background()
	bud := func() *Budget { return &Budget{CapMicros: 1e12, Window: "30d"} }
	scopes := []Scope{
		{Kind: KindKey, ID: "k", RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
		{Kind: KindTeam, ID: "t", RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
		{Kind: KindOrg, ID: bd.org, RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
	}
	start := time.Now()
	usec := func() (calls, usec int64) {
		info, err := bd.rdb.Info(ctx, "commandstats").Result()
		require.NoError(b, err)
		for _, line := range strings.Split(info, "\n") {
			if !strings.HasPrefix(line, "cmdstat_evalsha:") {
				continue
			}
			for _, kv := range strings.Split(strings.TrimSpace(strings.TrimPrefix(line, "cmdstat_evalsha:")), ",") {
				k, v, _ := strings.Cut(kv, "=")
				n, _ := strconv.ParseInt(v, 10, 64)
				switch k {
				case "calls":
					calls = n
				case "usec":
					usec = n
				}
			}
		}
		return calls, usec
	}
	// Warm up: scripts loaded, windows full.
	for i := 0; time.Since(start) < time.Second; i++ {
		d := bd.admit(b, bd.req(fmt.Sprint("w", i), 100, 1000, scopes...))
		_, err := bd.lim.Settle(ctx, d.Lease, 90, 900)
		require.NoError(b, err)
	}
	c0, u0 := usec()
	b.ResetTimer()
	for i := range b.N {
		d := bd.admit(b, bd.req(fmt.Sprint("r", i), 100, 1000, scopes...))
		if !d.Allowed {
			b.Fatalf("rejected: %+v", d.Rejection)
		}
		if _, err := bd.lim.Settle(ctx, d.Lease, 90, 900); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	c1, u1 := usec()
	hk := newKeyBuilder(bd.prefix, bd.org).scope(&scopes[0])[0]
	b.Logf("state hash of %s: %d fields, encoding %s", scopes[0].ID, bd.rdb.HLen(ctx, hk).Val(), bd.rdb.ObjectEncoding(ctx, hk).Val())
	b.ReportMetric(float64(u1-u0)/float64(c1-c0), "redis_us/evalsha")
	b.ReportMetric(float64(u1-u0)/float64(b.N), "redis_us/request")
}
