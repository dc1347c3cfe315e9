package system

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// TestLedgerBatchesExactlyOnceThroughNATSOutage: a data plane publishing
// batches (small buffer, so an outage spills to its spool) and one
// publishing single events (an older build's format, mid rolling upgrade)
// record concurrently, some requests twice, while NATS goes away and
// comes back. The ledger ends with exactly one row per request and exact
// aggregates.
func TestLedgerBatchesExactlyOnceThroughNATSOutage(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	batched := d.StartProxy("default", time.Hour, func(c *dataplane.Config) {
		c.UsageBufferSize, c.UsageSpoolDir = 40, t.TempDir()
	})
	single := d.StartProxy("default", time.Hour, func(c *dataplane.Config) { c.UsageBatchEvents = 1 })
	const org = "org_ledger_batches"
	var mu sync.Mutex
	evs := map[string]*usagev1.UsageEvent{}
	record := func(p *harness.Proxy, prefix string, from, to int) {
		for i := from; i < to; i++ {
			ev := ledgerEvent(org, prefix, i)
			mu.Lock()
			evs[ev.RequestId] = ev
			mu.Unlock()
			p.DP.RecordUsage(ev)
			if i%9 == 0 {
				p.DP.RecordUsage(ledgerEvent(org, prefix, i)) // the same request twice
			}
			if i%20 == 0 {
				time.Sleep(time.Millisecond)
			}
		}
	}
	var wg sync.WaitGroup
	phase := func(from, to int) {
		for w := range 4 {
			wg.Add(1)
			go func() { defer wg.Done(); record(batched, "b"+string(rune('a'+w)), from, to) }()
		}
		wg.Add(1)
		go func() { defer wg.Done(); record(single, "s", from, to) }()
		wg.Wait()
	}
	phase(0, 60)
	d.NATS.Stop()
	// Mid-batch: batches were in flight when NATS went. 4×340 events (and
	// their repeats) exceed the buffer (40) and the ack window (1,024
	// events): the rest is spooled.
	phase(60, 400)
	harness.Eventually(t, func() bool { return batched.DP.UsageStats().Spooled > 0 }, 10*time.Second, 10*time.Millisecond,
		"the batching data plane spooled nothing: %+v", batched.DP.UsageStats())
	d.NATS.Start()
	phase(400, 450)
	want := 5 * 450
	got := d.waitLedger(org, want, 90*time.Second)
	for id := range evs {
		require.Contains(t, got, id)
	}
	d.checkSums(org, evs)
	for name, p := range map[string]*harness.Proxy{"batched": batched, "single": single} {
		harness.Eventually(t, func() bool { st := p.DP.UsageStats(); return st.Buffered == 0 && st.SpoolBytes == 0 },
			30*time.Second, 20*time.Millisecond, "%s: %+v", name, p.DP.UsageStats())
		st := p.DP.UsageStats()
		require.Zero(t, st.Dropped, name)
		t.Logf("%s: %+v", name, st)
	}
	bs, ss := batched.DP.UsageStats(), single.DP.UsageStats()
	require.Less(t, bs.Messages, bs.Published/2, "the batching data plane sent batches")
	require.Equal(t, ss.Messages, ss.Published, "the other one sent single events")
}
