package system

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// Project and tag scopes across data planes (issue 17, item 4): a
// project's or a tag's limits are shared by keys of different teams and
// enforced fleet-wide by the same admission call as a team's
// (TestLimitsTeamConcurrencyAcrossProxies, TestLimitsBudgetUnderConcurrency
// are the models; these run on two data planes, at a smaller scale).

func (d *dist) labelScopeClient() adminv1connect.LabelScopeServiceClient {
	return adminv1connect.NewLabelScopeServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(testBootstrap)))
}

// labelKeys creates a project or tag scope named name in ten's org with
// limits l, and keys carrying the label in ten's team and in a second team
// of the org (the scope, not a team, is what they share). It returns the
// scope's id and the keys' ids and tokens.
func labelKeys(t *testing.T, d *dist, ten tenant, kind adminv1.LabelScopeKind, name string, l *adminv1.Limits) (string, []string, []string) {
	t.Helper()
	ctx := context.Background()
	c := d.Clients()
	ls, err := d.labelScopeClient().CreateLabelScope(ctx, connect.NewRequest(&adminv1.CreateLabelScopeRequest{
		OrgId: ten.OrgID, Kind: kind, Name: name, Limits: l}))
	require.NoError(t, err)
	other, err := c.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: ten.OrgID, Name: "other-" + name}))
	require.NoError(t, err)
	var ids, toks []string
	for i := range 4 {
		req := &adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID, Alias: fmt.Sprintf("%s-%d", name, i)}
		if i%2 == 1 {
			req.TeamId = other.Msg.Team.Id
		}
		if kind == adminv1.LabelScopeKind_LABEL_SCOPE_KIND_PROJECT {
			req.Project = name
		} else {
			req.Tags = []string{"unscoped-" + name, name}
			req.Project = fmt.Sprintf("p%d", i) // projects without scopes
		}
		k, err := c.Key.CreateKey(ctx, connect.NewRequest(req))
		require.NoError(t, err)
		ids, toks = append(ids, k.Msg.Key.Id), append(toks, k.Msg.Token)
	}
	return ls.Msg.LabelScope.Id, ids, toks
}

// labelScopeKind is the scope kind of rejections ("project", "tag").
func labelScopeKind(kind adminv1.LabelScopeKind) string {
	if kind == adminv1.LabelScopeKind_LABEL_SCOPE_KIND_PROJECT {
		return "project"
	}
	return "tag"
}

// TestLabelScopeConcurrencyAcrossProxies: a project (then a tag) with
// max_parallel_requests = 6, four keys of two teams carrying it, two data
// planes, 24 closed-loop clients streaming 0.2–0.8 s for 6 s. The upstream
// never sees more than 6 of the label in flight, reaches 6, and every
// refusal is 429 concurrency_limit_exceeded naming the label's scope.
func TestLabelScopeConcurrencyAcrossProxies(t *testing.T) {
	const (
		limit    = 6
		clients  = 24
		offerFor = 6 * time.Second
	)
	d := startDist(t)
	up := &lloadStreams{teams: map[string]*lloadGauge{}}
	srv := httptest.NewServer(up)
	t.Cleanup(srv.Close)
	lloadDeployment(t, d, "lconc", srv.URL, &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 2e-6})
	ten := d.NewTenant("lconc")
	type label struct {
		kind adminv1.LabelScopeKind
		name string
		id   string
		toks []string
	}
	labels := []*label{{kind: adminv1.LabelScopeKind_LABEL_SCOPE_KIND_PROJECT, name: "search"}, {kind: adminv1.LabelScopeKind_LABEL_SCOPE_KIND_TAG, name: "batch-eval"}}
	for _, lb := range labels {
		lb.id, _, lb.toks = labelKeys(t, d, ten, lb.kind, lb.name, &adminv1.Limits{MaxParallelRequests: proto.Int64(limit)})
	}
	ps := lloadProxies(t, d, 2)
	c := lloadClient(t)
	for _, lb := range labels {
		t.Run(labelScopeKind(lb.kind), func(t *testing.T) {
			body := func(dur time.Duration) string {
				return fmt.Sprintf(`{"model":"lconc","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"team=%s dur=%d"}]}`,
					lb.name, dur.Milliseconds())
			}
			for _, tok := range lb.toks {
				lloadWarm(t, c, ps, tok, body(10*time.Millisecond))
			}
			lloadDrain(t, ps)
			g := up.gauge(lb.name)
			harness.Eventually(t, func() bool { g.mu.Lock(); defer g.mu.Unlock(); return g.cur == 0 }, 5*time.Second, 10*time.Millisecond)
			g.mu.Lock()
			g.peak, g.ev = 0, nil
			g.mu.Unlock()

			var (
				wg       sync.WaitGroup
				mu       sync.Mutex
				statuses = map[string]int{}
				admitted int
				bad      []string
			)
			wantScope := labelScopeKind(lb.kind) + ":" + lb.id
			end := time.Now().Add(offerFor)
			for i := range clients {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(i), 17))
					tok, p := lb.toks[i%len(lb.toks)], ps[(i/len(lb.toks))%len(ps)]
					for time.Now().Before(end) {
						dur := 200*time.Millisecond + time.Duration(rng.Int64N(int64(600*time.Millisecond)))
						a := lloadPost(context.Background(), c, p.URL, tok, body(dur))
						mu.Lock()
						switch {
						case a.err != nil:
							bad = append(bad, a.err.Error())
						case a.status == http.StatusOK:
							admitted++
						case a.status == http.StatusTooManyRequests:
							if s := a.hdr.Get(dataplane.HeaderLimitScope); s != wantScope || a.hdr.Get(dataplane.HeaderLimitType) != "parallel" {
								bad = append(bad, fmt.Sprintf("429 naming %q %q", s, a.hdr.Get(dataplane.HeaderLimitType)))
							}
						}
						if a.err == nil {
							statuses[fmt.Sprintf("%d %s", a.status, a.code())]++
						}
						mu.Unlock()
						if a.status != http.StatusOK {
							time.Sleep(5 * time.Millisecond) // a refused client retries soon, not in a hot loop
						}
					}
				})
			}
			wg.Wait()
			lloadDrain(t, ps)
			g.mu.Lock()
			peak, streams := g.peak, len(g.ev)/2
			g.mu.Unlock()
			t.Logf("%s %q (max_parallel_requests %d), 4 keys of 2 teams, 2 data planes, %d clients for %s: answers %v; "+
				"%d streams reached the upstream; peak in flight %d", labelScopeKind(lb.kind), lb.name, limit, clients, offerFor, statuses, streams, peak)
			require.Empty(t, bad)
			require.LessOrEqual(t, peak, limit, "the upstream saw more than the %s's max_parallel_requests in flight", labelScopeKind(lb.kind))
			require.Equal(t, limit, peak, "the cap was reached (the clients offer 4× the cap)")
			require.Equal(t, admitted, streams, "every admitted request reached the upstream once")
			for k := range statuses {
				require.Contains(t, []string{"200 ", "429 " + dataplane.CodeConcurrencyLimitExceeded, "503 " + dataplane.CodeLimitsUnavailable}, k, "answers: %v", statuses)
			}
			require.Positive(t, statuses["429 "+dataplane.CodeConcurrencyLimitExceeded], "the cap refused requests")
		})
	}
	require.Zero(t, lloadLiveLeases(t, d), "leases left after drain")
}

// TestLabelScopeBudgetAcrossProxies: a project (then a tag) with
// max_budget $0.05 per "1d" window, four keys of two teams carrying it,
// two data planes, 16 concurrent clients hammering a priced deployment
// until every request is refused with 429 budget_exceeded naming the
// scope. The ledger's charged spend of the label is at most the cap plus
// one request's maximum cost reservation (docs/limits.md), the Redis
// counter equals the ledger, and after the scope's Redis budget state is
// lost, the data planes re-seed it from the ledger and keep refusing.
func TestLabelScopeBudgetAcrossProxies(t *testing.T) {
	const (
		capUSD    = 0.05
		clients   = 16
		maxOut    = 200
		inPrice   = 2e-6
		outPr     = 4e-6
		stopAfter = 100
	)
	msgs := `[{"role":"user","content":"` + strings.Repeat("y", 170) + `"}]` // 200 bytes
	const promptTokens = 200 / 4
	reserveUSD := float64((promptTokens*4+2)/3+16)*inPrice + maxOut*outPr
	reserveMicros := int64(math.Ceil(reserveUSD * 1e6))
	bound := capUSD + float64(reserveMicros)/1e6

	d := startDist(t)
	up := &lloadPriced{prompt: promptTokens, maxOut: maxOut, rng: rand.New(rand.NewPCG(7, 71)), usage: map[string][2]int64{}}
	srv := httptest.NewServer(up)
	t.Cleanup(srv.Close)
	lloadDeployment(t, d, "lpriced", srv.URL, &adminv1.Prices{InputPerToken: inPrice, OutputPerToken: outPr})
	ten := d.NewTenant("lbudget")
	type label struct {
		kind     adminv1.LabelScopeKind
		name, id string
		keys     []string
		toks     []string
	}
	labels := []*label{{kind: adminv1.LabelScopeKind_LABEL_SCOPE_KIND_PROJECT, name: "chatbot"}, {kind: adminv1.LabelScopeKind_LABEL_SCOPE_KIND_TAG, name: "nightly"}}
	for _, lb := range labels {
		lb.id, lb.keys, lb.toks = labelKeys(t, d, ten, lb.kind, lb.name, &adminv1.Limits{MaxBudget: proto.Float64(capUSD), BudgetDuration: "1d"})
	}
	ps := lloadProxies(t, d, 2)
	c := lloadClient(t)
	body := fmt.Sprintf(`{"model":"lpriced","max_tokens":%d,"messages":%s}`, maxOut, msgs)
	windowStart := time.Now().UTC()
	rdb := redis.NewClient(&redis.Options{Addr: testRedisAddr})
	t.Cleanup(func() { _ = rdb.Close() })

	for _, lb := range labels {
		t.Run(labelScopeKind(lb.kind), func(t *testing.T) {
			wantScope := labelScopeKind(lb.kind) + ":" + lb.id
			var (
				mu                       sync.Mutex
				answers                  []lloadAnswer
				bad                      []string
				admitted                 = map[string]bool{}
				other                    = map[string]int{}
				refusals, unavailable    int
				served, refused, unavail = 0, 1, 2
			)
			record := func(a lloadAnswer) int {
				mu.Lock()
				defer mu.Unlock()
				answers = append(answers, a)
				switch {
				case a.err != nil:
					other[a.err.Error()]++
				case a.status == http.StatusOK:
					admitted[a.id] = true
				case a.status == http.StatusTooManyRequests && a.code() == dataplane.CodeBudgetExceeded:
					refusals++
					if a.hdr.Get(dataplane.HeaderLimitScope) != wantScope || a.hdr.Get(dataplane.HeaderLimitType) != "budget" ||
						a.hdr.Get("X-Should-Retry") != "false" || !strings.Contains(string(a.body), labelScopeKind(lb.kind)+" "+lb.id) {
						bad = append(bad, fmt.Sprintf("scope %q type %q: %s", a.hdr.Get(dataplane.HeaderLimitScope), a.hdr.Get(dataplane.HeaderLimitType), a.body))
					}
					return refused
				case a.status == http.StatusServiceUnavailable && a.code() == dataplane.CodeLimitsUnavailable:
					unavailable++
					return unavail
				default:
					other[fmt.Sprintf("%d %s", a.status, a.code())]++
				}
				return served
			}
			hammer := func() {
				var streak atomic.Int64
				var wg sync.WaitGroup
				for i := range clients {
					wg.Go(func() {
						tok, p := lb.toks[i%len(lb.toks)], ps[(i/len(lb.toks))%len(ps)]
						for streak.Load() < stopAfter {
							switch record(lloadPost(context.Background(), c, p.URL, tok, body)) {
							case refused:
								streak.Add(1)
							case served:
								streak.Store(0)
							}
						}
					})
				}
				wg.Wait()
			}
			// everyRefused asks every data plane with every key once more
			// (after the settlements are in): all must be refused.
			everyRefused := func() bool {
				for _, p := range ps {
					for _, tok := range lb.toks {
						got := unavail
						for try := 0; got == unavail && try < 20; try++ {
							got = record(lloadPost(context.Background(), c, p.URL, tok, body))
						}
						if got != refused {
							return false
						}
					}
				}
				return true
			}
			for rounds := 1; ; rounds++ {
				hammer()
				lloadDrain(t, ps)
				if everyRefused() {
					break
				}
				require.Less(t, rounds, 5, "requests still admitted after %d hammering rounds", rounds)
			}
			require.Empty(t, bad, "budget refusals")
			require.Empty(t, other, "answers other than 200, 429 budget_exceeded and 503 limits_unavailable")

			// The ledger holds every request of the label's keys.
			var rows int
			if !harness.Until(func() bool {
				d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
					require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM spend_logs WHERE key_id = ANY($1)`, lb.keys).Scan(&rows))
				})
				return rows >= len(answers)
			}, 60*time.Second, 50*time.Millisecond) {
				t.Fatalf("spend_logs has %d of %d requests; spend consumer: %s", rows, len(answers), d.spendConsumerInfo())
			}
			var charged float64
			var n int
			d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
				require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 200), coalesce(sum(cost_usd), 0) FROM spend_logs WHERE key_id = ANY($1)`,
					lb.keys).Scan(&n, &charged))
			})
			require.Equal(t, len(admitted), n, "admitted requests in the ledger")
			counter, err := rdb.HGet(context.Background(), d.RedisPrefix+"{o:"+ten.OrgID+"}:lim:"+labelScopeKind(lb.kind)+":"+lb.id, "bs").Int64()
			require.NoError(t, err)
			t.Logf("%s %q: %d requests, %d admitted, %d refused with budget_exceeded naming %s, %d 503 limits_unavailable; charged $%.6f; "+
				"cap $%.2f, bound cap + one reservation $%.6f; overshoot %.2f reservations; Redis window counter $%.6f",
				labelScopeKind(lb.kind), lb.name, len(answers), len(admitted), refusals, wantScope, unavailable, charged, capUSD, bound,
				(charged-capUSD)*1e6/float64(reserveMicros), float64(counter)/1e6)
			if end := windowStart.Truncate(24 * time.Hour).Add(24 * time.Hour); time.Now().After(end) {
				t.Logf("the 1d budget window ended during the test (%s): the cap applies per window", end)
				return
			}
			require.LessOrEqual(t, charged, bound, "charged spend over the cap beyond the in-flight bound")
			require.GreaterOrEqual(t, counter, int64(math.Round(capUSD*1e6)), "Redis budget counter below the cap while refusing")
			require.InDelta(t, charged*1e6, float64(counter), float64(len(admitted)+1), "Redis budget counter = ledger (µUSD rounding per request)")

			// Redis loses the scope's budget state: the data planes re-seed
			// the window from the ledger (seeds responder) and still refuse.
			require.NoError(t, rdb.Del(context.Background(), d.RedisPrefix+"{o:"+ten.OrgID+"}:lim:"+labelScopeKind(lb.kind)+":"+lb.id).Err())
			for _, p := range ps {
				var a lloadAnswer
				ok := harness.Until(func() bool {
					a = lloadPost(context.Background(), c, p.URL, lb.toks[0], body)
					return a.status == http.StatusTooManyRequests && a.code() == dataplane.CodeBudgetExceeded
				}, 10*time.Second, 50*time.Millisecond)
				require.True(t, ok, "after losing its Redis state the %s budget must be re-seeded from the ledger and refuse; got %d %s",
					labelScopeKind(lb.kind), a.status, a.body)
				require.Equal(t, wantScope, a.hdr.Get(dataplane.HeaderLimitScope))
			}
			reseeded, err := rdb.HGet(context.Background(), d.RedisPrefix+"{o:"+ten.OrgID+"}:lim:"+labelScopeKind(lb.kind)+":"+lb.id, "bs").Int64()
			require.NoError(t, err)
			require.InDelta(t, charged*1e6, float64(reseeded), float64(len(admitted)+1), "re-seeded counter = ledger")
		})
	}
}
