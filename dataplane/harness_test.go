package dataplane

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/controlplane"
	"github.com/sluicegw/sluice/internal/testsvc"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

const (
	testPepper    = "1:dataplane-test-pepper-0123456789abcdefghij"
	testBootstrap = "dataplane-test-bootstrap-token-0123456789"
	// testKEK is the key ring of the test control plane and (by default)
	// of its data planes: base64 of the 32 bytes "dataplane-test-kek-0123456789abc".
	testKEK = "1:ZGF0YXBsYW5lLXRlc3Qta2VrLTAxMjM0NTY3ODlhYmM="
)

// dist is a running control plane with NATS and Postgres, and the data
// planes a test starts.
type dist struct {
	t     testing.TB
	nats  *testsvc.NATSServer
	dbURL string
	admin string // admin API base URL
	cps   []context.CancelFunc
	// redisURL and redisPrefix are the limits store of the test's data
	// planes: the machine's Redis with a key prefix of the test's own.
	redisURL, redisPrefix string
}

func startDist(t testing.TB) *dist {
	t.Helper()
	var b [6]byte
	_, _ = rand.Read(b[:])
	d := &dist{t: t, nats: testsvc.StartNATS(t), dbURL: testsvc.NewDatabase(t),
		redisURL: "redis://" + testRedisAddr + "/0", redisPrefix: "t" + hex.EncodeToString(b[:]) + ":"}
	t.Cleanup(func() { cleanRedisPrefix(t, d.redisURL, d.redisPrefix) })
	d.admin = d.startControl("cp-1")
	return d
}

// startControl starts a control-plane replica and returns its admin URL.
func (d *dist) startControl(instance string) string {
	d.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cp, err := controlplane.New(ctx, controlplane.Config{Logger: dbgLog("cp"),
		DatabaseURL: d.dbURL, AdminAddr: "127.0.0.1:0", NATSURL: d.nats.URL, InstanceID: instance,
		BootstrapToken: testBootstrap, KeyPepper: testPepper, KEK: testKEK,
		Publish: controlplane.PublishConfig{Debounce: 50 * time.Millisecond, TickInterval: 200 * time.Millisecond},
	})
	require.NoError(d.t, err)
	done := make(chan struct{})
	go func() { defer close(done); _ = cp.Run(ctx) }()
	d.t.Cleanup(func() { cancel(); <-done })
	d.cps = append(d.cps, cancel)
	return "http://" + cp.Addr()
}

// proxy is a running data plane.
type proxy struct {
	dp     *DataPlane
	url    string
	cancel context.CancelFunc
}

func (d *dist) startProxy(region string, maxStale time.Duration, opts ...func(*Config)) *proxy {
	d.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cfg := Config{Logger: dbgLog("dp"), Region: region, NATSURL: d.nats.URL, Addr: "127.0.0.1:0", KeyPepper: testPepper, KEK: testKEK,
		MaxStaleness: maxStale, HeartbeatInterval: 200 * time.Millisecond, RedisURL: d.redisURL, RedisKeyPrefix: d.redisPrefix}
	for _, o := range opts {
		o(&cfg)
	}
	dp, err := New(ctx, cfg)
	require.NoError(d.t, err)
	done := make(chan struct{})
	go func() { defer close(done); _ = dp.Run(ctx) }()
	d.t.Cleanup(func() { cancel(); <-done })
	p := &proxy{dp: dp, url: "http://" + dp.Addr(), cancel: cancel}
	require.Eventually(d.t, func() bool { return dp.sync.Ready() }, 15*time.Second, 10*time.Millisecond, "data plane never loaded a snapshot")
	return p
}

type bearerInterceptor string

func (b bearerInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}
func (b bearerInterceptor) WrapStreamingClient(n connect.StreamingClientFunc) connect.StreamingClientFunc {
	return n
}
func (b bearerInterceptor) WrapStreamingHandler(n connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return n
}

type adminClients struct {
	Org     adminv1connect.OrgServiceClient
	Team    adminv1connect.TeamServiceClient
	User    adminv1connect.UserServiceClient
	Key     adminv1connect.KeyServiceClient
	Rollout adminv1connect.RolloutServiceClient
	Fleet   adminv1connect.FleetServiceClient
}

func (d *dist) clients() adminClients {
	opt := connect.WithInterceptors(bearerInterceptor(testBootstrap))
	hc := http.DefaultClient
	return adminClients{
		Org: adminv1connect.NewOrgServiceClient(hc, d.admin, opt), Team: adminv1connect.NewTeamServiceClient(hc, d.admin, opt),
		User: adminv1connect.NewUserServiceClient(hc, d.admin, opt), Key: adminv1connect.NewKeyServiceClient(hc, d.admin, opt),
		Rollout: adminv1connect.NewRolloutServiceClient(hc, d.admin, opt), Fleet: adminv1connect.NewFleetServiceClient(hc, d.admin, opt),
	}
}

// tenant is an org with a team, a user and a key.
type tenant struct {
	OrgID, TeamID, UserID, KeyID, Token string
}

func (d *dist) mkTenant(name string) tenant {
	d.t.Helper()
	ctx := context.Background()
	c := d.clients()
	o, err := c.Org.CreateOrg(ctx, connect.NewRequest(&adminv1.CreateOrgRequest{Name: name}))
	require.NoError(d.t, err)
	tm, err := c.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: o.Msg.Org.Id, Name: "team"}))
	require.NoError(d.t, err)
	u, err := c.User.CreateUser(ctx, connect.NewRequest(&adminv1.CreateUserRequest{OrgId: o.Msg.Org.Id, Email: name + "@example.com"}))
	require.NoError(d.t, err)
	_, err = c.Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: tm.Msg.Team.Id, UserId: u.Msg.User.Id}))
	require.NoError(d.t, err)
	k, err := c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: o.Msg.Org.Id, TeamId: tm.Msg.Team.Id, UserId: u.Msg.User.Id}))
	require.NoError(d.t, err)
	return tenant{OrgID: o.Msg.Org.Id, TeamID: tm.Msg.Team.Id, UserID: u.Msg.User.Id, KeyID: k.Msg.Key.Id, Token: k.Msg.Token}
}

// check calls /v1/auth/check and returns the status and the error code.
func check(t testing.TB, p *proxy, tok string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, p.url+"/v1/auth/check", nil)
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

// waitStatus polls until the proxy answers want for tok.
func waitStatus(t testing.TB, p *proxy, tok string, want int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		got, code := check(t, p, tok)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("proxy %s answered %d (%s), want %d within %s", p.url, got, code, want, within)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func contains(s, sub string) bool { return strings.Contains(s, sub) }

// dbgLog returns a debug logger to stderr for the planes of a test when
// SLUICE_TEST_LOG is set (nil, i.e. discard, otherwise).
func dbgLog(who string) *slog.Logger {
	if os.Getenv("SLUICE_TEST_LOG") == "" {
		return nil
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("who", who)
}

// testRedisAddr is the machine's Redis; tests fail when it is missing.
const testRedisAddr = "127.0.0.1:6379"

// cleanRedisPrefix deletes the keys a test left under prefix.
func cleanRedisPrefix(t testing.TB, url, prefix string) {
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
