package system

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// The usage batching benchmark (issue 15, item 4): NATS and control-plane
// CPU per usage event, one event per JetStream message ("before", a data
// plane with --usage-batch-events 1, the format of builds before batches)
// against batches ("after", the default), in the same run.
//
// NATS (benchnats: JetStream, fsync per write) and the control plane (the
// `sluice control` binary: its spend consumer writes the ledger to
// Postgres) run as their own processes, as in BenchmarkProxyOverhead; their
// CPU is read from /proc. Two data planes run in the benchmark process,
// one per variant; each phase records usage events through one of them at
// a fixed rate (SLUICE_BENCH_USAGE_RATE, default 5,000 events/s, in 1 ms
// ticks) for SLUICE_BENCH_USAGE_SECONDS (default 5), then waits until
// every event of the phase is a spend_logs row, and charges the CPU the two
// processes used from the phase's start to that moment to its events,
// less their idle cost (measured after each round) for the time the
// phase drained beyond its recording: the figures are CPU per event at
// the rate recorded, which a variant that falls behind does not get
// charged extra fixed cost for.
// Phases alternate over SLUICE_BENCH_ROUNDS rounds (default 3); the
// figures are medians. Postgres CPU (every postgres process on the
// machine, so other load on it shows) is reported but not part of the
// target.
//
//	make bench-usage

type usageBenchResult struct {
	events, messages int64
	// rate is the rate events were recorded at; ledgerRate the rate they
	// reached spend_logs at (events ÷ time from the phase's start until
	// the ledger held them all): the rate the pipeline sustained.
	rate, ledgerRate float64
	spooled          int64 // events that overflowed the buffer to the spool
	// used is the CPU the phase used, from its start until the ledger held
	// its events (window); recording is how long events were recorded.
	used              infraCPU
	window, recording time.Duration
	cpu               infraCPU // per event: used, less the idle cost of window - recording
}

// charge sets r.cpu: CPU per event at the benchmark's rate. A phase that
// drained for longer than it recorded (its pipeline fell behind) also
// used the processes' fixed cost (idle, per second) meanwhile; at a steady
// rate that cost is paid per second of recording, not per second of
// draining, so the excess is taken out (which lowers the figure of the
// slower variant).
func (r *usageBenchResult) charge(idle infraCPU) {
	extra := (r.window - r.recording).Seconds()
	if extra < 0 {
		extra = 0
	}
	less := func(used, perSecond time.Duration) time.Duration {
		return max(used-time.Duration(float64(perSecond)*extra), 0)
	}
	r.cpu = infraCPU{less(r.used.nats, idle.nats), less(r.used.control, idle.control), less(r.used.postgres, idle.postgres)}.div(r.events)
}

func usageBenchEnv(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func BenchmarkUsageBatching(b *testing.B) {
	d, infra := startBenchInfra(b)
	ctx := context.Background()
	rate := usageBenchEnv("SLUICE_BENCH_USAGE_RATE", 5000)
	seconds := usageBenchEnv("SLUICE_BENCH_USAGE_SECONDS", 5)
	rounds := usageBenchEnv("SLUICE_BENCH_ROUNDS", 3)

	variants := []struct {
		name  string
		proxy *harness.Proxy
	}{
		{"before (1 event/message)", d.StartProxy("default", time.Hour, func(c *dataplane.Config) { c.UsageBatchEvents = 1 })},
		{"after (batches)", d.StartProxy("default", time.Hour)},
	}
	pg, err := pgx.Connect(ctx, d.DatabaseURL)
	require.NoError(b, err)
	defer func() { _ = pg.Close(ctx) }()
	rows := func() int64 {
		var n int64
		require.NoError(b, pg.QueryRow(ctx, `SELECT count(*) FROM spend_logs`).Scan(&n))
		return n
	}
	var total int64 // events recorded so far (each a distinct request)
	waitLedger := func() {
		harness.Eventually(b, func() bool { return rows() >= total }, 3*time.Minute, 20*time.Millisecond,
			"spend_logs has %d of %d usage events", rows(), total)
	}
	seq := 0
	event := func(v int) *usagev1.UsageEvent {
		seq++
		return &usagev1.UsageEvent{
			RequestId: fmt.Sprintf("req_bench_%d_%09d", v, seq), Time: timestamppb.Now(), Region: "default",
			InstanceId: "bench-dp", KeyId: fmt.Sprintf("key_%d", seq%50), UserId: "user_1", TeamId: fmt.Sprintf("team_%d", seq%5),
			OrgId: "org_bench", Project: "bench", TrafficClass: "interactive", Route: "/v1/chat/completions",
			RequestedModel: "bench", ModelGroup: "bench", DeploymentId: "dep_bench", PromptTokens: 42, CompletionTokens: 38,
			CostUsd: 42e-6 + 76e-6, Status: 200, LatencyMs: 3, Attempts: 1, TrafficClassReason: "default", RoutingReason: "load",
		}
	}
	phase := func(v int, p *harness.Proxy) usageBenchResult {
		waitLedger()
		st0 := p.DP.UsageStats()
		c0 := infra()
		start := time.Now()
		tick := time.NewTicker(time.Millisecond)
		var n int64
		for end := start.Add(time.Duration(seconds) * time.Second); time.Now().Before(end); <-tick.C {
			// Catch up to the schedule (ticks are dropped under load).
			want := int64(time.Since(start).Seconds() * float64(rate))
			for ; n < want; n++ {
				p.DP.RecordUsage(event(v))
			}
		}
		tick.Stop()
		elapsed := time.Since(start)
		total += n
		waitLedger()
		caughtUp := time.Since(start)
		used := infra().sub(c0)
		st1 := p.DP.UsageStats()
		require.Zero(b, st1.Dropped-st0.Dropped)
		return usageBenchResult{events: n, messages: st1.Messages - st0.Messages, rate: float64(n) / elapsed.Seconds(),
			ledgerRate: float64(n) / caughtUp.Seconds(), spooled: st1.Spooled - st0.Spooled,
			used: used, window: caughtUp, recording: elapsed}
	}

	// idle measures the two processes' CPU per second with no events (the
	// control plane's ticks, heartbeats, outbox and consumers' polls), to
	// tell the fixed cost from the per-event one.
	idle := func() infraCPU {
		waitLedger()
		c0, t0 := infra(), time.Now()
		time.Sleep(time.Duration(seconds) * time.Second)
		used := infra().sub(c0)
		per := time.Since(t0)
		return infraCPU{nats: time.Duration(float64(used.nats) / per.Seconds()), control: time.Duration(float64(used.control) / per.Seconds()),
			postgres: time.Duration(float64(used.postgres) / per.Seconds())}
	}
	all := make([][]usageBenchResult, len(variants))
	var idles []infraCPU
	for range b.N {
		infra() // lowers the priority of the control plane's Postgres backends
		for range rounds {
			for i, v := range variants {
				all[i] = append(all[i], phase(i, v.proxy))
			}
			idles = append(idles, idle())
		}
	}
	waitLedger()
	require.Equal(b, total, rows(), "spend_logs rows = usage events recorded")
	slices.SortFunc(idles, func(a, b infraCPU) int { return int((a.nats + a.control) - (b.nats + b.control)) })
	id := idles[len(idles)/2]
	var drained []string // phases charged less idle cost
	for i := range all {
		for r := range all[i] {
			all[i][r].charge(id)
			if d := all[i][r].window - all[i][r].recording; d > time.Second {
				drained = append(drained, fmt.Sprintf("%s round %d drained %.1f s", variants[i].name, r+1, d.Seconds()))
			}
		}
	}

	med := func(rs []usageBenchResult, f func(usageBenchResult) float64) float64 {
		v := make([]float64, len(rs))
		for i, r := range rs {
			v[i] = f(r)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	us := func(d float64) string { return fmt.Sprintf("%.1fµs", d/float64(time.Microsecond)) }
	natsCP := func(r usageBenchResult) float64 { return float64(r.cpu.nats + r.cpu.control) }
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%d round(s) of %d s at %d events/s per variant, interleaved; medians; NATS and control plane at nice %d\n",
		rounds*b.N, seconds, rate, infraNice())
	fmt.Fprintf(&sb, "| variant | events/s recorded | events/s into the ledger | spooled | events/message | NATS CPU/event | control plane CPU/event | NATS + control plane | Postgres CPU/event (machine-wide) |\n|---|---|---|---|---|---|---|---|---|\n")
	figs := make([]float64, len(variants))
	for i, v := range variants {
		rs := all[i]
		figs[i] = med(rs, natsCP)
		fmt.Fprintf(&sb, "| %s | %.0f | %.0f | %.0f | %.1f | %s | %s | %s | %s |\n", v.name, med(rs, func(r usageBenchResult) float64 { return r.rate }),
			med(rs, func(r usageBenchResult) float64 { return r.ledgerRate }), med(rs, func(r usageBenchResult) float64 { return float64(r.spooled) }),
			med(rs, func(r usageBenchResult) float64 { return float64(r.events) / float64(max(r.messages, 1)) }),
			us(med(rs, func(r usageBenchResult) float64 { return float64(r.cpu.nats) })),
			us(med(rs, func(r usageBenchResult) float64 { return float64(r.cpu.control) })),
			us(figs[i]), us(med(rs, func(r usageBenchResult) float64 { return float64(r.cpu.postgres) })))
	}
	fmt.Fprintf(&sb, "idle (no events, median of %d): NATS %s/s, control plane %s/s of CPU: at %d events/s %s per event of the figures above is this fixed cost\n",
		len(idles), us(float64(id.nats)), us(float64(id.control)), rate, us(float64(id.nats+id.control)/float64(rate)))
	if len(drained) > 0 {
		fmt.Fprintf(&sb, "idle cost not charged for the seconds a phase drained beyond its %d s of recording: %s\n", seconds, strings.Join(drained, ", "))
	}
	ratios := make([]float64, 0, len(all[0]))
	for r := range all[0] {
		ratio := natsCP(all[1][r]) / natsCP(all[0][r])
		ratios = append(ratios, ratio)
		fmt.Fprintf(&sb, "round %d: NATS + control plane per event before %s after %s (%.3f×)\n", r+1,
			us(natsCP(all[0][r])), us(natsCP(all[1][r])), ratio)
	}
	slices.Sort(ratios)
	ratio := ratios[len(ratios)/2]
	fmt.Fprintf(&sb, "after/before, NATS + control plane CPU per event: %.3f× (median of the rounds' ratios; target ≤ 0.2)\n", ratio)
	fmt.Fprintf(&sb, "ledger: %d usage events recorded, %d spend_logs rows\n", total, rows())
	b.Log(sb.String())
	b.ReportMetric(ratio, "after/before_cpu")
	b.ReportMetric(figs[0]/float64(time.Microsecond), "before_us/event")
	b.ReportMetric(figs[1]/float64(time.Microsecond), "after_us/event")
}
