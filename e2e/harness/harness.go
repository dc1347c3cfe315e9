// Package harness starts the pieces of a whole Sluice system for the
// end-to-end tests and benchmarks in e2e/: a Postgres database cloned from
// the migrated template, an embedded NATS server with JetStream, a Redis key
// prefix of the test's own, control-plane replicas and data planes. What a
// test needs from a running data plane it reads through the exported
// methods of dataplane.DataPlane (dataplane/inspect.go), never through
// unexported fields.
package harness

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"os"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/controlplane"
	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	"github.com/sluicegw/sluice/internal/testsvc"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

const (
	// Pepper is the key pepper of the test planes.
	Pepper = "1:dataplane-test-pepper-0123456789abcdefghij"
	// Bootstrap is the admin token of the test control planes.
	Bootstrap = "dataplane-test-bootstrap-token-0123456789"
	// KEK is the key ring of the test control plane and (by default) of
	// its data planes: base64 of the 32 bytes "dataplane-test-kek-0123456789abc".
	KEK = "1:ZGF0YXBsYW5lLXRlc3Qta2VrLTAxMjM0NTY3ODlhYmM="
	// RedisAddr is the machine's Redis; tests fail when it is missing.
	RedisAddr = "127.0.0.1:6379"
)

// Dist is a running control plane with NATS and Postgres, and the data
// planes a test starts. Tests that assemble a system of their own (another
// database URL, an out-of-process NATS) fill the fields themselves.
type Dist struct {
	// T is the test (or benchmark) the system belongs to; every process
	// of it stops at T's cleanup.
	T testing.TB
	// NATS is the embedded NATS server.
	NATS *testsvc.NATSServer
	// DatabaseURL is the control plane's database, cloned from the
	// migrated template.
	DatabaseURL string
	// Admin is the admin API base URL of the first control plane.
	Admin string
	// Controls holds the cancel functions of the control planes started,
	// in start order (cancelling one stops that replica).
	Controls []context.CancelFunc
	// RedisURL and RedisPrefix are the limits store of the data planes:
	// the machine's Redis with a key prefix of the test's own.
	RedisURL, RedisPrefix string
}

// Start starts NATS, a database and Redis prefix of the test's own and one
// control plane ("cp-1"), all stopped (and the prefix's keys deleted) at
// cleanup.
func Start(t testing.TB) *Dist {
	t.Helper()
	var b [6]byte
	_, _ = rand.Read(b[:])
	d := &Dist{T: t, NATS: testsvc.StartNATS(t), DatabaseURL: testsvc.NewDatabase(t),
		RedisURL: "redis://" + RedisAddr + "/0", RedisPrefix: "t" + hex.EncodeToString(b[:]) + ":"}
	t.Cleanup(func() { CleanRedisPrefix(t, d.RedisURL, d.RedisPrefix) })
	d.Admin = d.StartControl("cp-1")
	return d
}

// StartControl starts a control-plane replica (publishing with a 50 ms
// debounce) and returns its admin URL.
func (d *Dist) StartControl(instance string) string {
	d.T.Helper()
	return d.StartControlConfig(controlplane.Config{Logger: DebugLogger("cp"),
		DatabaseURL: d.DatabaseURL, InstanceID: instance,
		Publish: controlplane.PublishConfig{Debounce: 50 * time.Millisecond, TickInterval: 200 * time.Millisecond},
	})
}

// StartControlConfig starts a control-plane replica with cfg; the admin
// address, the NATS URL and the secrets are filled in where cfg leaves
// them empty. It returns the admin URL; the replica stops at cleanup.
func (d *Dist) StartControlConfig(cfg controlplane.Config) string {
	d.T.Helper()
	if cfg.AdminAddr == "" {
		cfg.AdminAddr = "127.0.0.1:0"
	}
	if cfg.NATSURL == "" {
		cfg.NATSURL = d.NATS.URL
	}
	if cfg.BootstrapToken == "" {
		cfg.BootstrapToken = Bootstrap
	}
	if cfg.KeyPepper == "" {
		cfg.KeyPepper = Pepper
	}
	if cfg.KEK == "" {
		cfg.KEK = KEK
	}
	ctx, cancel := context.WithCancel(context.Background())
	cp, err := controlplane.New(ctx, cfg)
	require.NoError(d.T, err)
	done := make(chan struct{})
	go func() { defer close(done); _ = cp.Run(ctx) }()
	d.T.Cleanup(func() { cancel(); <-done })
	d.Controls = append(d.Controls, cancel)
	return "http://" + cp.Addr()
}

// Proxy is a running data plane.
type Proxy struct {
	// DP is the data plane; its exported methods (dataplane/inspect.go)
	// show its catalog, sync state and counters.
	DP *dataplane.DataPlane
	// URL is its base URL (http://host:port).
	URL string
	// Cancel stops it and returns once it has stopped (its shutdown's last
	// Redis writes, such as quota slices given back, are done: a test that
	// cleans Redis next does not get them afterwards).
	Cancel func()
}

// StartProxy starts a data plane of region on the Dist's NATS and Redis
// prefix, applies opts to its configuration and waits until it has loaded
// a snapshot. It stops at cleanup (or on Cancel).
func (d *Dist) StartProxy(region string, maxStale time.Duration, opts ...func(*dataplane.Config)) *Proxy {
	d.T.Helper()
	cfg := dataplane.Config{Logger: DebugLogger("dp"), Region: region, NATSURL: d.NATS.URL, Addr: "127.0.0.1:0", KeyPepper: Pepper, KEK: KEK,
		MaxStaleness: maxStale, HeartbeatInterval: 200 * time.Millisecond, RedisURL: d.RedisURL, RedisKeyPrefix: d.RedisPrefix}
	for _, o := range opts {
		o(&cfg)
	}
	return d.StartProxyConfig(cfg)
}

// StartProxyConfig starts a data plane with cfg exactly as given and
// waits until it has loaded a snapshot. It stops at cleanup (or on Cancel).
func (d *Dist) StartProxyConfig(cfg dataplane.Config) *Proxy {
	d.T.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	dp, err := dataplane.New(ctx, cfg)
	require.NoError(d.T, err)
	done := make(chan struct{})
	go func() { defer close(done); _ = dp.Run(ctx) }()
	stop := func() { cancel(); <-done }
	d.T.Cleanup(stop)
	p := &Proxy{DP: dp, URL: "http://" + dp.Addr(), Cancel: stop}
	Eventually(d.T, dp.Ready, 15*time.Second, 10*time.Millisecond, "data plane never loaded a snapshot")
	return p
}

// BearerInterceptor sets the bearer token on every admin API call.
type BearerInterceptor string

// WrapUnary sets the Authorization header.
func (b BearerInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}

// WrapStreamingClient passes streams through (the admin API has none).
func (b BearerInterceptor) WrapStreamingClient(n connect.StreamingClientFunc) connect.StreamingClientFunc {
	return n
}

// WrapStreamingHandler passes streams through.
func (b BearerInterceptor) WrapStreamingHandler(n connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return n
}

// AdminClients are the admin API clients the tests use.
type AdminClients struct {
	Org     adminv1connect.OrgServiceClient
	Team    adminv1connect.TeamServiceClient
	User    adminv1connect.UserServiceClient
	Key     adminv1connect.KeyServiceClient
	Rollout adminv1connect.RolloutServiceClient
	Fleet   adminv1connect.FleetServiceClient
}

// Clients returns admin clients of the first control plane.
func (d *Dist) Clients() AdminClients { return ClientsAt(d.Admin) }

// ClientsAt returns admin clients of the control plane at url, with the
// bootstrap token.
func ClientsAt(url string) AdminClients {
	opt := connect.WithInterceptors(BearerInterceptor(Bootstrap))
	hc := http.DefaultClient
	return AdminClients{
		Org: adminv1connect.NewOrgServiceClient(hc, url, opt), Team: adminv1connect.NewTeamServiceClient(hc, url, opt),
		User: adminv1connect.NewUserServiceClient(hc, url, opt), Key: adminv1connect.NewKeyServiceClient(hc, url, opt),
		Rollout: adminv1connect.NewRolloutServiceClient(hc, url, opt), Fleet: adminv1connect.NewFleetServiceClient(hc, url, opt),
	}
}

// Tenant is an org with a team, a user and a key.
type Tenant struct {
	OrgID, TeamID, UserID, KeyID, Token string
}

// NewTenant creates an org named name with a team, a user in it and a key
// of that user, and returns them with the key's token.
func (d *Dist) NewTenant(name string) Tenant {
	d.T.Helper()
	ctx := context.Background()
	c := d.Clients()
	o, err := c.Org.CreateOrg(ctx, connect.NewRequest(&adminv1.CreateOrgRequest{Name: name}))
	require.NoError(d.T, err)
	tm, err := c.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: o.Msg.Org.Id, Name: "team"}))
	require.NoError(d.T, err)
	u, err := c.User.CreateUser(ctx, connect.NewRequest(&adminv1.CreateUserRequest{OrgId: o.Msg.Org.Id, Email: name + "@example.com"}))
	require.NoError(d.T, err)
	_, err = c.Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: tm.Msg.Team.Id, UserId: u.Msg.User.Id}))
	require.NoError(d.T, err)
	k, err := c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: o.Msg.Org.Id, TeamId: tm.Msg.Team.Id, UserId: u.Msg.User.Id}))
	require.NoError(d.T, err)
	return Tenant{OrgID: o.Msg.Org.Id, TeamID: tm.Msg.Team.Id, UserID: u.Msg.User.Id, KeyID: k.Msg.Key.Id, Token: k.Msg.Token}
}

// Check calls /v1/auth/check on p with tok and returns the status and the
// error code.
func Check(t testing.TB, p *Proxy, tok string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, p.URL+"/v1/auth/check", nil)
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var e struct {
		Error struct {
			Code string `json:"code"`
		} `json:"error"`
	}
	_ = json.Unmarshal(body, &e)
	return resp.StatusCode, e.Error.Code
}

// WaitStatus polls until p answers want for tok, failing after within.
func WaitStatus(t testing.TB, p *Proxy, tok string, want int, within time.Duration) {
	t.Helper()
	var got int
	var code string
	if !Until(func() bool { got, code = Check(t, p, tok); return got == want }, within, 10*time.Millisecond) {
		t.Fatalf("proxy %s answered %d (%s), want %d within %s", p.URL, got, code, want, within)
	}
}

// DebugLogger returns a debug logger to stderr for the planes of a test
// when SLUICE_TEST_LOG is set (nil, i.e. discard, otherwise).
func DebugLogger(who string) *slog.Logger {
	if os.Getenv("SLUICE_TEST_LOG") == "" {
		return nil
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("who", who)
}

// CleanRedisPrefix deletes the keys a test left under prefix.
func CleanRedisPrefix(t testing.TB, url, prefix string) {
	opt, err := redis.ParseURL(url)
	if err != nil {
		return
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	iter := rdb.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	var keys []string
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
		if len(keys) == 500 {
			rdb.Del(ctx, keys...)
			keys = keys[:0]
		}
	}
	if len(keys) > 0 {
		rdb.Del(ctx, keys...)
	}
}

// StartSim starts a simulated vLLM engine with cfg (its logs discarded)
// and closes it at cleanup.
func StartSim(t testing.TB, cfg vllmsim.Config) *vllmsim.Server {
	t.Helper()
	sim, err := vllmsim.Start(cfg, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	t.Cleanup(func() { _ = sim.Close() })
	return sim
}
