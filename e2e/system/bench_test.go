package system

// Benchmarks of config distribution (issue 3, "Must show"): revocation
// latency across three data planes, and a 100k-key snapshot. Both run the
// real control plane, Postgres and an embedded JetStream server through
// the harness in harness_test.go. Run them with `make bench-distribution`
// (docs/distribution.md records the figures).

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"testing"
	"time"

	"github.com/sluicegw/sluice/e2e/harness"

	"github.com/sluicegw/sluice/dataplane"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

const (
	// minRevocations is how many revocations BenchmarkRevocation measures
	// whatever b.N is: the issue asks for a p99 over at least 100.
	minRevocations = 100
	// revocationPoll is the polling period of every data plane.
	revocationPoll = 10 * time.Millisecond
	// revocationGiveUp bounds one wait for a data plane to answer; far
	// above the 1 s target, so a slow revocation is measured, not lost.
	revocationGiveUp = 10 * time.Second
)

// revocationRig is a control plane with three data planes of one region
// and a few tenants whose keys answer 200 everywhere.
type revocationRig struct {
	d       *dist
	c       adminClients
	proxies []*proxy
	tenants []tenant
	hc      *http.Client
}

func newRevocationRig(tb testing.TB, nTenants int) *revocationRig {
	tb.Helper()
	d := startDist(tb)
	r := &revocationRig{d: d, c: d.Clients(),
		hc: &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 8}}}
	tb.Cleanup(r.hc.CloseIdleConnections)
	for i := range nTenants {
		r.tenants = append(r.tenants, d.NewTenant(fmt.Sprintf("revoke-%d", i)))
	}
	for range 3 {
		r.proxies = append(r.proxies, d.StartProxy("default", time.Minute))
	}
	for _, ten := range r.tenants {
		r.waitAll(tb, ten.Token, http.StatusOK, "")
	}
	return r
}

// authCheck is one GET /v1/auth/check; it is safe in any goroutine (no
// testing.TB).
func (r *revocationRig) authCheck(ctx context.Context, p *proxy, tok string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.URL+"/v1/auth/check", nil)
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := r.hc.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, "", err
	}
	var e struct {
		Error struct {
			Code string `json:"code"`
		} `json:"error"`
	}
	_ = json.Unmarshal(body, &e)
	return resp.StatusCode, e.Error.Code, nil
}

// pollAll polls every data plane every revocationPoll until it answers
// want (and code, if not empty) for tok, concurrently, and returns the
// time the last one did.
func (r *revocationRig) pollAll(tok string, want int, code string) (time.Time, error) {
	ctx, cancel := context.WithTimeout(context.Background(), revocationGiveUp)
	defer cancel()
	type result struct {
		at  time.Time
		err error
	}
	res := make(chan result, len(r.proxies))
	for _, p := range r.proxies {
		go func() {
			t := time.NewTicker(revocationPoll)
			defer t.Stop()
			for {
				got, gotCode, err := r.authCheck(ctx, p, tok)
				if err != nil {
					res <- result{err: fmt.Errorf("data plane %s: %w", p.URL, err)}
					return
				}
				if got == want && (code == "" || gotCode == code) {
					res <- result{at: time.Now()}
					return
				}
				select {
				case <-ctx.Done():
					res <- result{err: fmt.Errorf("data plane %s still answers %d (%s), want %d %s after %s", p.URL, got, gotCode, want, code, revocationGiveUp)}
					return
				case <-t.C:
				}
			}
		}()
	}
	var last time.Time
	var firstErr error
	for range r.proxies {
		x := <-res
		if x.err != nil && firstErr == nil {
			firstErr = x.err
		}
		if x.at.After(last) {
			last = x.at
		}
	}
	return last, firstErr
}

func (r *revocationRig) waitAll(tb testing.TB, tok string, want int, code string) {
	tb.Helper()
	_, err := r.pollAll(tok, want, code)
	require.NoError(tb, err)
}

// revocationLevel blocks and unblocks one scope of a tenant.
type revocationLevel struct {
	code           string
	block, unblock func(ctx context.Context, c adminClients, t tenant) error
}

var revocationLevels = []revocationLevel{
	{"key_blocked", func(ctx context.Context, c adminClients, t tenant) error {
		_, err := c.Key.BlockKey(ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: t.KeyID}))
		return err
	}, func(ctx context.Context, c adminClients, t tenant) error {
		_, err := c.Key.UnblockKey(ctx, connect.NewRequest(&adminv1.UnblockKeyRequest{Id: t.KeyID}))
		return err
	}},
	{"user_blocked", func(ctx context.Context, c adminClients, t tenant) error {
		_, err := c.User.BlockUser(ctx, connect.NewRequest(&adminv1.BlockUserRequest{Id: t.UserID}))
		return err
	}, func(ctx context.Context, c adminClients, t tenant) error {
		_, err := c.User.UnblockUser(ctx, connect.NewRequest(&adminv1.UnblockUserRequest{Id: t.UserID}))
		return err
	}},
	{"team_blocked", func(ctx context.Context, c adminClients, t tenant) error {
		_, err := c.Team.BlockTeam(ctx, connect.NewRequest(&adminv1.BlockTeamRequest{Id: t.TeamID}))
		return err
	}, func(ctx context.Context, c adminClients, t tenant) error {
		_, err := c.Team.UnblockTeam(ctx, connect.NewRequest(&adminv1.UnblockTeamRequest{Id: t.TeamID}))
		return err
	}},
	{"org_blocked", func(ctx context.Context, c adminClients, t tenant) error {
		_, err := c.Org.BlockOrg(ctx, connect.NewRequest(&adminv1.BlockOrgRequest{Id: t.OrgID}))
		return err
	}, func(ctx context.Context, c adminClients, t tenant) error {
		_, err := c.Org.UnblockOrg(ctx, connect.NewRequest(&adminv1.UnblockOrgRequest{Id: t.OrgID}))
		return err
	}},
}

// revocation is one measured block.
type revocation struct {
	level string
	// fromReturn runs from the Block RPC's return to the last data plane
	// answering 403; fromStart from the RPC's start.
	fromReturn, fromStart time.Duration
}

// revoke runs revocation number i: it blocks one scope (key, user, team,
// org in turn) of one tenant (in turn), polls every data plane until all
// answer 403 with that scope's code, then unblocks and waits until all
// answer 200 again, so the next revocation starts from a clean state.
func (r *revocationRig) revoke(tb testing.TB, i int) revocation {
	tb.Helper()
	ctx := context.Background()
	lvl := revocationLevels[i%len(revocationLevels)]
	ten := r.tenants[(i/len(revocationLevels))%len(r.tenants)]
	start := time.Now()
	require.NoError(tb, lvl.block(ctx, r.c, ten))
	returned := time.Now()
	last, err := r.pollAll(ten.Token, http.StatusForbidden, lvl.code)
	require.NoError(tb, err, "revocation %d (%s)", i, lvl.code)
	require.NoError(tb, lvl.unblock(ctx, r.c, ten))
	r.waitAll(tb, ten.Token, http.StatusOK, "")
	return revocation{level: lvl.code, fromReturn: last.Sub(returned), fromStart: last.Sub(start)}
}

// checkBaseline is the median round trip of a plain, successful
// /v1/auth/check over n calls spread over the data planes.
func (r *revocationRig) checkBaseline(tb testing.TB, n int) time.Duration {
	tb.Helper()
	var d []time.Duration
	for i := range n {
		p := r.proxies[i%len(r.proxies)]
		start := time.Now()
		got, code, err := r.authCheck(context.Background(), p, r.tenants[0].Token)
		d = append(d, time.Since(start))
		require.NoError(tb, err)
		require.Equal(tb, http.StatusOK, got, code)
	}
	return harness.Percentile(d, 50)
}

func durMS(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// TestRevocationLatencySmoke is the CI-sized revocation benchmark: ten
// blocks across key, user, team and org, each enforced by all three data
// planes within the 1 s target.
func TestRevocationLatencySmoke(t *testing.T) {
	t.Parallel()
	r := newRevocationRig(t, 2)
	for i := range 10 {
		rv := r.revoke(t, i)
		require.LessOrEqual(t, rv.fromReturn, time.Second, "revocation %d (%s) took %s after the RPC returned", i, rv.level, rv.fromReturn)
		t.Logf("revocation %d %-13s %6.1f ms after return, %6.1f ms after start", i, rv.level, durMS(rv.fromReturn), durMS(rv.fromStart))
	}
}

// BenchmarkRevocation measures how long a block takes to be enforced by
// every one of three data planes, polled every 10 ms (issue 3: p99 ≤
// 500 ms, max ≤ 1 s over ≥ 100 revocations).
//
// One op is one revocation (block, all three answer 403, unblock, all
// three answer 200). The harness starts once; if b.N is below
// minRevocations, more revocations run after the timed loop so the
// percentiles always cover at least minRevocations. Metrics:
//
//	p50_ms, p99_ms, max_ms            Block RPC return → last data plane answering 403
//	p50_from_start_ms, p99_from_start_ms   the same from the RPC's start
//	check_p50_ms                      median plain /v1/auth/check round trip (baseline, same run)
//	p50_over_check                    p50_ms / check_p50_ms
//	revocations                       number of revocations measured
func BenchmarkRevocation(b *testing.B) {
	r := newRevocationRig(b, 5)
	base := r.checkBaseline(b, 300)
	var got []revocation
	for b.Loop() {
		got = append(got, r.revoke(b, len(got)))
	}
	for len(got) < minRevocations {
		got = append(got, r.revoke(b, len(got)))
	}
	var fromReturn, fromStart []time.Duration
	for _, rv := range got {
		fromReturn = append(fromReturn, rv.fromReturn)
		fromStart = append(fromStart, rv.fromStart)
	}
	p50, p99, worst := harness.Percentile(fromReturn, 50), harness.Percentile(fromReturn, 99), harness.Percentile(fromReturn, 100)
	b.ReportMetric(durMS(p50), "p50_ms")
	b.ReportMetric(durMS(p99), "p99_ms")
	b.ReportMetric(durMS(worst), "max_ms")
	b.ReportMetric(durMS(harness.Percentile(fromStart, 50)), "p50_from_start_ms")
	b.ReportMetric(durMS(harness.Percentile(fromStart, 99)), "p99_from_start_ms")
	b.ReportMetric(durMS(base), "check_p50_ms")
	b.ReportMetric(float64(p50)/float64(base), "p50_over_check")
	b.ReportMetric(float64(len(got)), "revocations")
	b.Logf("%d revocations: p50 %.1f ms, p99 %.1f ms, max %.1f ms (auth check p50 %.2f ms)", len(got), durMS(p50), durMS(p99), durMS(worst), durMS(base))
	if p99 > 500*time.Millisecond || worst > time.Second {
		b.Errorf("revocation target missed: p99 %s (≤ 500ms), max %s (≤ 1s)", p99, worst)
	}
}

// Scale benchmark shape: 100,000 keys spread over 1,000 orgs with 10
// teams and 10 users each (one membership per user, 10 keys per user).
const (
	scaleOrgs        = 1000
	scaleTeamsPerOrg = 10
	scaleUsersPerOrg = 10
	scaleKeys        = 100_000
)

// scaleSQL inserts the benchmark tenants in bulk, bypassing the admin API
// (and the outbox: a resync request compiles them). Ids have the shape of
// real ids (prefix and 32 hex digits), so sizes are realistic; token
// hashes are SHA-256 of the key number: unique 32 bytes, but no token
// authenticates with them.
var scaleSQL = []string{
	fmt.Sprintf(`INSERT INTO orgs (id, name, limits, created_at, updated_at)
SELECT 'org_' || lpad(to_hex(o), 32, '0'), 'bench-org-' || o, '{"rpm_limit": 10000, "max_budget": 1000, "budget_duration": "30d"}', now(), now()
FROM generate_series(1, %d) o`, scaleOrgs),
	fmt.Sprintf(`INSERT INTO teams (id, org_id, name, limits, created_at, updated_at)
SELECT 'team_' || lpad(to_hex(t), 32, '0'), 'org_' || lpad(to_hex((t - 1) / %[1]d + 1), 32, '0'), 'team-' || t, '{"rpm_limit": 1000}', now(), now()
FROM generate_series(1, %[2]d) t`, scaleTeamsPerOrg, scaleOrgs*scaleTeamsPerOrg),
	fmt.Sprintf(`INSERT INTO users (id, org_id, email, created_at, updated_at)
SELECT 'user_' || lpad(to_hex(u), 32, '0'), 'org_' || lpad(to_hex((u - 1) / %[1]d + 1), 32, '0'), 'user' || u || '@example.com', now(), now()
FROM generate_series(1, %[2]d) u`, scaleUsersPerOrg, scaleOrgs*scaleUsersPerOrg),
	// User u is a member of team u (both are the ((u-1) mod 10)-th of
	// their org, as teams and users per org are equal).
	fmt.Sprintf(`INSERT INTO team_members (team_id, user_id, org_id, created_at, updated_at)
SELECT 'team_' || lpad(to_hex(u), 32, '0'), 'user_' || lpad(to_hex(u), 32, '0'), 'org_' || lpad(to_hex((u - 1) / %[1]d + 1), 32, '0'), now(), now()
FROM generate_series(1, %[2]d) u`, scaleUsersPerOrg, scaleOrgs*scaleUsersPerOrg),
	// Key k belongs to user (k-1) mod 10000 + 1, in that user's team.
	fmt.Sprintf(`INSERT INTO keys (id, org_id, team_id, user_id, alias, token_hash, pepper_version, display_prefix, last4, tags, limits, created_at, updated_at)
SELECT 'key_' || lpad(to_hex(k), 32, '0'),
       'org_' || lpad(to_hex(((k - 1) %% %[1]d) / %[2]d + 1), 32, '0'),
       'team_' || lpad(to_hex((k - 1) %% %[1]d + 1), 32, '0'),
       'user_' || lpad(to_hex((k - 1) %% %[1]d + 1), 32, '0'),
       'bench-' || k, sha256(('bench-key-' || k)::bytea), 1, 'sk-sluice-bench', lpad((k %% 10000)::text, 4, '0'),
       '{bench}', '{"rpm_limit": 60, "tpm_limit": 100000}', now(), now()
FROM generate_series(1, %[3]d) k`, scaleOrgs*scaleUsersPerOrg, scaleUsersPerOrg, scaleKeys),
}

// BenchmarkScale100kKeys measures a 100,000-key configuration (issue 3,
// target: apply ≤ 1 s). The tenants are inserted in bulk, a resync request
// makes the control plane compile them, and then:
//
//	compile_ms        resync request → the new pointer visible in KV (includes the
//	                  harness's 50 ms debounce, the Postgres read, encoding, the
//	                  object-store write and the KV write)
//	encode_ms         of that: encoding the snapshot (measured apart)
//	store_ms          of that: writing it to the object store (measured apart)
//	size_bytes        encoded snapshot
//	apply_ms          data-plane apply, median: wire.DecodeSnapshot (digest, schema) +
//	                  catalog.FromSnapshot, with the previous catalog live (the op
//	                  of the timed loop; ns/op is its mean)
//	apply_max_ms      the slowest apply
//	heap_mb           live heap held by one applied catalog (after GC)
//	proxy_ready_ms    a new data plane from start to ready (fetch + apply)
func BenchmarkScale100kKeys(b *testing.B) {
	d := startDist(b)
	ctx := context.Background()
	nc, err := nats.Connect(d.NATS.URL)
	require.NoError(b, err)
	b.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(b, err)

	// The control plane's first compile (empty configuration).
	var kv jetstream.KeyValue
	harness.Eventually(b, func() bool {
		kv, err = js.KeyValue(ctx, wire.PointerBucket)
		if err != nil {
			return false
		}
		_, err = kv.Get(ctx, wire.PointerKey("default"))
		return err == nil
	}, 15*time.Second, 10*time.Millisecond, "no initial snapshot pointer")
	before := readPointer(b, kv)

	conn, err := pgx.Connect(ctx, d.DatabaseURL)
	require.NoError(b, err)
	insertStart := time.Now()
	for _, q := range scaleSQL {
		_, err := conn.Exec(ctx, q)
		require.NoError(b, err, q)
	}
	require.NoError(b, conn.Close(ctx))
	b.Logf("inserted %d keys in %s", scaleKeys, time.Since(insertStart).Round(time.Millisecond))

	watch, err := kv.Watch(ctx, wire.PointerKey("default"), jetstream.UpdatesOnly())
	require.NoError(b, err)
	defer func() { _ = watch.Stop() }()
	compileStart := time.Now()
	require.NoError(b, nc.Publish(wire.ResyncSubject, []byte("default")))
	var ptr *configv1.SnapshotPointer
	timeout := time.After(2 * time.Minute)
	for ptr == nil {
		select {
		case e := <-watch.Updates():
			if e == nil {
				continue
			}
			p := &configv1.SnapshotPointer{}
			require.NoError(b, proto.Unmarshal(e.Value(), p))
			if p.GetVersion() > before.GetVersion() {
				ptr = p
			}
		case <-timeout:
			b.Fatal("no new snapshot pointer within 2 minutes of the resync request")
		}
	}
	compile := time.Since(compileStart)

	obs, err := js.ObjectStore(ctx, wire.SnapshotBucket)
	require.NoError(b, err)
	body, err := obs.GetBytes(ctx, ptr.GetObject())
	require.NoError(b, err)

	// Two parts of the compile, measured apart: encoding the snapshot and
	// writing it to the object store (the rest is the Postgres read and
	// conversion, the debounce and the pointer writes).
	decoded, err := wire.DecodeSnapshot(body, ptr)
	require.NoError(b, err)
	encodeStart := time.Now()
	_, _, err = wire.EncodeSnapshot(decoded)
	require.NoError(b, err)
	encode := time.Since(encodeStart)
	storeStart := time.Now()
	_, err = obs.PutBytes(ctx, "bench-copy", body)
	require.NoError(b, err)
	store := time.Since(storeStart)
	require.NoError(b, obs.Delete(ctx, "bench-copy"))

	// Heap held by one applied catalog: live heap after GC with it, minus
	// live heap after GC without it.
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	applyStart := time.Now()
	cat := applySnapshot(b, body, ptr)
	firstApply := time.Since(applyStart)
	runtime.GC()
	runtime.ReadMemStats(&m1)
	require.Equal(b, scaleKeys, cat.Counts()["keys"])
	heap := float64(int64(m1.HeapAlloc)-int64(m0.HeapAlloc)) / (1 << 20)
	runtime.KeepAlive(cat)

	proxyStart := time.Now()
	p := d.StartProxy("default", time.Minute)
	proxyReady := time.Since(proxyStart)
	require.Equal(b, ptr.GetVersion(), p.DP.Catalog().Version)
	require.Equal(b, scaleKeys, p.DP.Catalog().Counts()["keys"])

	// Each timed apply starts like a data plane's: the running catalog
	// live, no garbage of earlier applies pending (collected untimed), so
	// the figure does not depend on how many iterations ran before.
	b.ReportAllocs()
	var applies []time.Duration
	for b.Loop() {
		b.StopTimer()
		runtime.GC()
		b.StartTimer()
		start := time.Now()
		next := applySnapshot(b, body, ptr)
		applies = append(applies, time.Since(start))
		cat = next
	}
	runtime.KeepAlive(cat)
	applies = append(applies, firstApply)
	apply, applyMax := harness.Percentile(applies, 50), harness.Percentile(applies, 100)
	b.ReportMetric(durMS(compile), "compile_ms")
	b.ReportMetric(float64(len(body)), "size_bytes")
	b.ReportMetric(durMS(encode), "encode_ms")
	b.ReportMetric(durMS(store), "store_ms")
	b.ReportMetric(durMS(apply), "apply_ms")
	b.ReportMetric(durMS(applyMax), "apply_max_ms")
	b.ReportMetric(heap, "heap_mb")
	b.ReportMetric(durMS(proxyReady), "proxy_ready_ms")
	b.Logf("%d keys: compile %s (encode %s, object store write %s), size %.1f MB, apply median %s max %s over %d, heap %.1f MB, proxy ready %s",
		scaleKeys, compile.Round(time.Millisecond), encode.Round(time.Millisecond), store.Round(time.Millisecond),
		float64(len(body))/(1<<20), apply.Round(time.Millisecond), applyMax.Round(time.Millisecond), len(applies),
		heap, proxyReady.Round(time.Millisecond))
	if apply > time.Second {
		b.Errorf("apply target missed: median %s (≤ 1s)", apply)
	}
}

func readPointer(tb testing.TB, kv jetstream.KeyValue) *configv1.SnapshotPointer {
	tb.Helper()
	e, err := kv.Get(context.Background(), wire.PointerKey("default"))
	require.NoError(tb, err)
	p := &configv1.SnapshotPointer{}
	require.NoError(tb, proto.Unmarshal(e.Value(), p))
	return p
}

// applySnapshot is what a data plane does with a fetched snapshot body.
func applySnapshot(tb testing.TB, body []byte, ptr *configv1.SnapshotPointer) *dataplane.Catalog {
	s, err := wire.DecodeSnapshot(body, ptr)
	if err != nil {
		tb.Fatal(err)
	}
	c, err := dataplane.CatalogFromSnapshot(s, ptr.GetRegionSeq())
	if err != nil {
		tb.Fatal(err)
	}
	return c
}
