package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/controlplane"
	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	"github.com/sluicegw/sluice/internal/keyring"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// devDatabase is the database `sluice dev` uses (created if missing).
const devDatabase = "sluice_dev"

// devState is written to --state-file for scripts and tests.
type devState struct {
	AdminURL   string            `json:"admin_url"`
	ProxyURL   string            `json:"proxy_url"`
	NATSURL    string            `json:"nats_url"`
	Engines    map[string]string `json:"engines"`
	AdminToken string            `json:"admin_token"`
	OrgID      string            `json:"org_id"`
	TeamID     string            `json:"team_id"`
	Keys       map[string]string `json:"keys"`
}

// devSecrets persist between `sluice dev` runs so issued tokens stay valid.
type devSecrets struct {
	AdminToken string `json:"admin_token"`
	KeyPepper  string `json:"key_pepper"`
	// KEK is the key ring sealing upstream credentials (SLUICE_KEK).
	KEK string `json:"kek"`
}

func runDev(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("sluice dev", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("addr", envOr(getenv, "SLUICE_ADMIN_ADDR", controlplane.DefaultAdminAddr), "admin API listen address")
	dbURL := fs.String("database-url", envOr(getenv, "SLUICE_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/"+devDatabase+"?sslmode=disable"), "Postgres URL; the database is created if missing")
	stateFile := fs.String("state-file", ".sluice/dev.json", "where to write URLs and tokens as JSON")
	proxyAddr := fs.String("proxy-addr", dataplane.DefaultAddr, "data-plane proxy listen address")
	redisURL := fs.String("redis-url", envOr(getenv, "SLUICE_REDIS_URL", dataplane.DefaultRedisURL), "limits store (SLUICE_REDIS_URL)")
	natsPort := fs.Int("nats-port", 4223, "port of the embedded NATS server (JetStream data under .sluice/nats)")
	level, format := logFlags(fs, getenv, "text")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	log, err := newLogger(stderr, *level, *format)
	if err != nil {
		return err
	}
	if err := ensureDatabase(ctx, *dbURL); err != nil {
		return err
	}
	sec, err := loadDevSecrets(filepath.Join(filepath.Dir(*stateFile), "dev-secrets.json"), getenv)
	if err != nil {
		return err
	}
	ns, err := startDevNATS(filepath.Join(filepath.Dir(*stateFile), "nats"), *natsPort)
	if err != nil {
		return err
	}
	defer ns.Shutdown()
	natsURL := ns.ClientURL()
	cp, err := controlplane.New(ctx, controlplane.Config{
		DatabaseURL: *dbURL, AdminAddr: *addr, NATSURL: natsURL, InstanceID: "dev-control",
		BootstrapToken: sec.AdminToken, KeyPepper: sec.KeyPepper, KEK: sec.KEK, Migrate: true, Logger: log,
	})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 3)
	go func() { errc <- cp.Run(ctx) }()
	dp, err := dataplane.New(ctx, dataplane.Config{
		Region: dataplane.DefaultRegion, InstanceID: "dev-proxy", NATSURL: natsURL, Addr: *proxyAddr,
		KeyPepper: sec.KeyPepper, KEK: sec.KEK, Logger: log, RedisURL: *redisURL, RedisKeyPrefix: "sluice-dev:",
		SoleDataPlane: true, // the only data plane of the dev fleet
	})
	if err != nil {
		cancel()
		<-errc
		return err
	}
	go func() { errc <- dp.Run(ctx) }()
	engines, err := startDevEngines(log)
	if err != nil {
		cancel()
		return err
	}
	defer func() {
		for _, e := range engines {
			_ = e.Close()
		}
	}()

	adminURL := "http://" + cp.Addr()
	engineURLs := map[string]string{}
	for name, e := range engines {
		engineURLs[name] = e.URL()
	}
	st, err := seedDemo(ctx, adminURL, sec.AdminToken, engineURLs)
	st.ProxyURL, st.NATSURL, st.Engines = "http://"+dp.Addr(), natsURL, engineURLs
	if err != nil {
		cancel()
		<-errc
		return fmt.Errorf("seed demo data: %w", err)
	}
	if err := writeJSONFile(*stateFile, st); err != nil {
		cancel()
		<-errc
		return err
	}
	fmt.Fprintf(stdout, `
Sluice dev is running.

  admin API    %s   (Connect RPC; JSON over HTTP/1.1 or h2c)
  proxy        %s   (OpenAI API, data plane of region "default")
  engines      interactive=%s  agents=%s   (vllm-sim)
  nats         %s   (embedded, JetStream)
  admin token  %s   (platform admin; from SLUICE_ADMIN_TOKEN or .sluice/dev-secrets.json)
  demo org     %s
  keys         human=%s
               agent=%s
  state file   %s

Try it:
  curl -s -H 'Authorization: Bearer %s' -H 'Content-Type: application/json' \
    -d '{}' %s/sluice.admin.v1.AdminTokenService/WhoAmI
  go run ./cmd/sluicectl login --server %s --token %s
  go run ./cmd/sluicectl key list

  curl -s %s/v1/chat/completions -H 'Authorization: Bearer %s' \
    -H 'Content-Type: application/json' \
    -d '{"model":"%s","messages":[{"role":"user","content":"Hello!"}],"max_tokens":32}'

The agent key asks for the same model and lands on the agents engine.
Press Ctrl-C to stop.
`, adminURL, st.ProxyURL, st.Engines["interactive"], st.Engines["agents"], natsURL, st.AdminToken, st.OrgID, st.Keys["human"], st.Keys["agent"], *stateFile,
		st.AdminToken, adminURL, adminURL, st.AdminToken, st.ProxyURL, st.Keys["human"], devModel)
	return <-errc
}

// ensureDatabase creates the database of dbURL if it does not exist.
func ensureDatabase(ctx context.Context, dbURL string) error {
	u, err := url.Parse(dbURL)
	if err != nil {
		return fmt.Errorf("database URL does not parse")
	}
	name := strings.TrimPrefix(u.Path, "/")
	if name == "" || strings.ContainsAny(name, `"/ `) {
		return fmt.Errorf("database URL must name a database")
	}
	u.Path = "/postgres"
	conn, err := pgx.Connect(ctx, u.String())
	if err != nil {
		return fmt.Errorf("connect postgres (is it running? try deploy/local/services.sh): %w", err)
	}
	defer conn.Close(ctx)
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err != nil {
		return fmt.Errorf("check database: %w", err)
	}
	if exists {
		return nil
	}
	if _, err := conn.Exec(ctx, `CREATE DATABASE "`+name+`"`); err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}

// randomBase64 returns n random bytes in standard base64 (a key ring key).
func randomBase64(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return base64.StdEncoding.EncodeToString(b)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// loadDevSecrets takes secrets from the environment, else from path,
// generating and saving them (mode 0600) on the first run.
func loadDevSecrets(path string, getenv func(string) string) (devSecrets, error) {
	var s devSecrets
	if b, err := os.ReadFile(path); err == nil {
		if err := json.Unmarshal(b, &s); err != nil {
			return s, fmt.Errorf("read %s: %w", path, err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return s, err
	}
	changed := false
	if s.AdminToken == "" {
		s.AdminToken, changed = "dev-admin-"+randomHex(24), true
	}
	if s.KeyPepper == "" {
		s.KeyPepper, changed = "1:"+randomHex(32), true
	}
	if s.KEK == "" {
		s.KEK, changed = "1:"+randomBase64(keyring.KeySize), true
	}
	if changed {
		if err := writeJSONFile(path, s); err != nil {
			return s, err
		}
	}
	if v, err := secret(getenv, "SLUICE_ADMIN_TOKEN"); err != nil {
		return s, err
	} else if v != "" {
		s.AdminToken = v
	}
	if v, err := secret(getenv, "SLUICE_KEY_PEPPER"); err != nil {
		return s, err
	} else if v != "" {
		s.KeyPepper = v
	}
	if v, err := secret(getenv, "SLUICE_KEK"); err != nil {
		return s, err
	} else if v != "" {
		s.KEK = v
	}
	return s, nil
}

func writeJSONFile(path string, v any) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

type bearerAuth string

func (b bearerAuth) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}
func (b bearerAuth) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}
func (b bearerAuth) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// seedDemo creates (or finds) the demo org, team, users and keys through
// the admin API, like any client would. Keys that exist are rotated so the
// printed tokens are valid.
func seedDemo(ctx context.Context, adminURL, adminToken string, engines map[string]string) (devState, error) {
	hc := &http.Client{Timeout: 30 * time.Second}
	opt := connect.WithInterceptors(bearerAuth(adminToken))
	orgs := adminv1connect.NewOrgServiceClient(hc, adminURL, opt)
	teams := adminv1connect.NewTeamServiceClient(hc, adminURL, opt)
	users := adminv1connect.NewUserServiceClient(hc, adminURL, opt)
	keys := adminv1connect.NewKeyServiceClient(hc, adminURL, opt)
	models := adminv1connect.NewModelServiceClient(hc, adminURL, opt)
	st := devState{AdminURL: adminURL, AdminToken: adminToken, Keys: map[string]string{}}
	if err := seedModels(ctx, models, engines); err != nil {
		return st, err
	}

	ol, err := orgs.ListOrgs(ctx, connect.NewRequest(&adminv1.ListOrgsRequest{NamePrefix: "demo"}))
	if err != nil {
		return st, err
	}
	for _, o := range ol.Msg.Orgs {
		if o.Name == "demo" {
			st.OrgID = o.Id
		}
	}
	if st.OrgID == "" {
		o, err := orgs.CreateOrg(ctx, connect.NewRequest(&adminv1.CreateOrgRequest{
			Name: "demo", Limits: &adminv1.Limits{MaxBudget: proto.Float64(100), BudgetDuration: "30d"},
		}))
		if err != nil {
			return st, err
		}
		st.OrgID = o.Msg.Org.Id
	}
	tl, err := teams.ListTeams(ctx, connect.NewRequest(&adminv1.ListTeamsRequest{OrgId: st.OrgID, NamePrefix: "platform"}))
	if err != nil {
		return st, err
	}
	for _, t := range tl.Msg.Teams {
		if t.Name == "platform" {
			st.TeamID = t.Id
		}
	}
	if st.TeamID == "" {
		t, err := teams.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{
			OrgId: st.OrgID, Name: "platform",
			Limits: &adminv1.Limits{RpmLimit: proto.Int64(600), MaxParallelRequests: proto.Int64(32)},
		}))
		if err != nil {
			return st, err
		}
		st.TeamID = t.Msg.Team.Id
	}
	userIDs := map[string]string{}
	for _, email := range []string{"alice@demo.example", "build-agent@demo.example"} {
		ul, err := users.ListUsers(ctx, connect.NewRequest(&adminv1.ListUsersRequest{OrgId: st.OrgID, EmailPrefix: email}))
		if err != nil {
			return st, err
		}
		for _, u := range ul.Msg.Users {
			if u.Email == email {
				userIDs[email] = u.Id
			}
		}
		if userIDs[email] == "" {
			u, err := users.CreateUser(ctx, connect.NewRequest(&adminv1.CreateUserRequest{OrgId: st.OrgID, Email: email}))
			if err != nil {
				return st, err
			}
			userIDs[email] = u.Msg.User.Id
			if _, err := teams.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: st.TeamID, UserId: u.Msg.User.Id})); err != nil {
				return st, err
			}
		}
	}
	demoKeys := []struct {
		alias, user string
		class       adminv1.TrafficClass
		limits      *adminv1.Limits
		aliases     map[string]string
	}{
		{"human", "alice@demo.example", adminv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE, &adminv1.Limits{RpmLimit: proto.Int64(60)}, nil},
		// The agent key asks for the same model name but is routed to the
		// agents pool: the credential decides, not the client.
		{"agent", "build-agent@demo.example", adminv1.TrafficClass_TRAFFIC_CLASS_AGENT, &adminv1.Limits{MaxParallelRequests: proto.Int64(8)},
			map[string]string{devModel: devModel + "-agents"}},
	}
	for _, k := range demoKeys {
		kl, err := keys.ListKeys(ctx, connect.NewRequest(&adminv1.ListKeysRequest{OrgId: st.OrgID, TeamId: st.TeamID, AliasPrefix: k.alias}))
		if err != nil {
			return st, err
		}
		var existing string
		for _, have := range kl.Msg.Keys {
			if have.Alias == k.alias {
				existing = have.Id
			}
		}
		if existing != "" {
			r, err := keys.RotateKey(ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: existing}))
			if err != nil {
				return st, err
			}
			st.Keys[k.alias] = r.Msg.Token
			continue
		}
		r, err := keys.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{
			OrgId: st.OrgID, TeamId: st.TeamID, UserId: userIDs[k.user], Alias: k.alias, TrafficClass: k.class, Limits: k.limits,
			ModelGroupAliases: k.aliases,
		}))
		if err != nil {
			return st, err
		}
		st.Keys[k.alias] = r.Msg.Token
	}
	return st, nil
}

// devModel is the model name the demo serves.
const devModel = "qwen-30b"

// seedModels creates the demo model groups and points one deployment of
// each at its simulated engine (updating api_base when the engine moved).
func seedModels(ctx context.Context, models adminv1connect.ModelServiceClient, engines map[string]string) error {
	for group, engine := range map[string]string{devModel: "interactive", devModel + "-agents": "agents"} {
		if _, err := models.GetModelGroup(ctx, connect.NewRequest(&adminv1.GetModelGroupRequest{Name: group})); connect.CodeOf(err) == connect.CodeNotFound {
			if _, err := models.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{
				Name: group, Description: "demo group served by the " + engine + " vllm-sim engine"})); err != nil {
				return err
			}
		} else if err != nil {
			return err
		}
		apiBase := engines[engine] + "/v1"
		dl, err := models.ListDeployments(ctx, connect.NewRequest(&adminv1.ListDeploymentsRequest{ModelGroup: group}))
		if err != nil {
			return err
		}
		if len(dl.Msg.Deployments) > 0 {
			d := dl.Msg.Deployments[0]
			if d.ApiBase != apiBase {
				if _, err := models.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
					Deployment: &adminv1.Deployment{Id: d.Id, ApiBase: apiBase},
					UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"api_base"}},
				})); err != nil {
					return err
				}
			}
			continue
		}
		if _, err := models.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
			ModelGroup: group, ApiBase: apiBase, UpstreamModel: vllmsim.DefaultModel, Weight: 1, MaxConcurrency: 64,
			Capabilities: &adminv1.Capabilities{Tools: true, JsonMode: true, MaxInputTokens: 32768, MaxOutputTokens: 4096},
			Prices:       &adminv1.Prices{InputPerToken: 0.0000002, OutputPerToken: 0.0000006},
		})); err != nil {
			return err
		}
	}
	return nil
}

// startDevNATS runs an embedded NATS server with JetStream on loopback.
func startDevNATS(dir string, port int) (*server.Server, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: dir,
		NoLog: true, NoSigs: true, SyncAlways: true})
	if err != nil {
		return nil, fmt.Errorf("embedded nats: %w", err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		ns.Shutdown()
		return nil, fmt.Errorf("embedded nats did not start on port %d (in use? pass --nats-port)", port)
	}
	return ns, nil
}

// startDevEngines runs two simulated vLLM pools: one for interactive
// traffic and one for agents.
func startDevEngines(log *slog.Logger) (map[string]*vllmsim.Server, error) {
	out := map[string]*vllmsim.Server{}
	for _, name := range []string{"interactive", "agents"} {
		cfg := vllmsim.DefaultConfig()
		cfg.Addr = "127.0.0.1:0"
		s, err := vllmsim.Start(cfg, log.With("engine", name))
		if err != nil {
			for _, e := range out {
				_ = e.Close()
			}
			return nil, fmt.Errorf("start %s engine: %w", name, err)
		}
		out[name] = s
	}
	return out, nil
}
