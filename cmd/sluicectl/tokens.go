package main

import (
	"context"
	"errors"
	"flag"
	"fmt"

	"google.golang.org/protobuf/proto"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

var tokenColumns = []column[*adminv1.AdminToken]{
	{"ID", (*adminv1.AdminToken).GetId},
	{"NAME", (*adminv1.AdminToken).GetName},
	{"SCOPE", func(t *adminv1.AdminToken) string { return enumName(t.GetScope().Descriptor(), t.GetScope().Number()) }},
	{"ORG", (*adminv1.AdminToken).GetOrgId},
	{"TEAM", (*adminv1.AdminToken).GetTeamId},
	{"ROLE", func(t *adminv1.AdminToken) string { return enumName(t.GetRole().Descriptor(), t.GetRole().Number()) }},
	{"TOKEN", func(t *adminv1.AdminToken) string { return tokenHint(t.GetDisplayPrefix(), t.GetLast4()) }},
	{"EXPIRES", func(t *adminv1.AdminToken) string { return formatTime(t.GetExpireTime()) }},
	{"REVOKED", func(t *adminv1.AdminToken) string { return formatTime(t.GetRevokeTime()) }},
}

func tokenCommand() *command {
	return group("token", "manage admin tokens (the credentials sluicectl uses)", []*command{
		leaf("create", "", "create an admin token; it is printed once", runTokenCreate),
		listCommand("", "list admin tokens", tokenColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.AdminToken] {
			req := &adminv1.ListAdminTokensRequest{}
			fs.StringVar(&req.OrgId, "org", "", "only tokens of this org")
			fs.StringVar(&req.TeamId, "team", "", "only tokens of this team")
			fs.BoolVar(&req.IncludeRevoked, "include-revoked", false, "also list revoked tokens")
			return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.AdminToken, string, error) {
				req.PageSize, req.PageToken = size, tok
				r, err := call(ctx, c.tokens.ListAdminTokens, req)
				return r.GetAdminTokens(), r.GetNextPageToken(), err
			}
		}),
		idCommand("revoke", "TOKEN", "revoke an admin token: it stops working at once", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.tokens.RevokeAdminToken, &adminv1.RevokeAdminTokenRequest{Id: id})
			return r.GetAdminToken(), err
		}),
		deleteCommand("admin token", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			return call(ctx, c.tokens.DeleteAdminToken, &adminv1.DeleteAdminTokenRequest{Id: id})
		}),
		leaf("rotate", "TOKEN_ID", "give a token a new secret (printed once); --grace keeps the old one working for a while", runTokenRotate),
		leaf("expire", "TOKEN_ID", "set a token's expiry (--at), or clear it (--never)", runTokenExpire),
	}, "tokens")
}

func runTokenRotate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	req := &adminv1.RotateAdminTokenRequest{}
	fs.StringVar(&req.GracePeriod, "grace", "", "how long the old secret keeps working, e.g. 1h or 7d (at most 30d; default: refused at once)")
	pos, cl, p, err := a.parseConnect(fs, c, 1, 1)
	if err != nil {
		return err
	}
	req.Id = pos[0]
	r, err := call(ctx, cl.tokens.RotateAdminToken, req)
	if err != nil {
		return err
	}
	return p.one(r, r.GetAdminToken(), [2]string{"token (shown once)", r.GetToken()})
}

func runTokenExpire(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	req := &adminv1.UpdateAdminTokenExpiryRequest{}
	fs.Var(&timeValue{p: &req.ExpireTime}, "at", "new expiry: RFC 3339 time, a date, or a duration from now (30d, 12h)")
	never := fs.Bool("never", false, "clear the expiry")
	pos, err := a.parse(fs, c, 1, 1)
	if err != nil {
		return err
	}
	if (req.ExpireTime == nil) == !*never {
		return errors.New("give exactly one of --at and --never")
	}
	req.Id = pos[0]
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.tokens.UpdateAdminTokenExpiry, req)
	return p.result(r.GetAdminToken(), err)
}

func runTokenCreate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	req := &adminv1.CreateAdminTokenRequest{}
	fs.StringVar(&req.Name, "name", "", "name of the token, for humans (default: SCOPE-ROLE, e.g. org-admin)")
	fs.Var(newEnum(&req.Scope, adminv1.Scope_value, "SCOPE_"), "scope", "platform, org or team (default: team with --team, org with --org)")
	fs.StringVar(&req.OrgId, "org", "", "org the token is scoped to (org and team scopes; default: the org of --team, else your token's org)")
	fs.StringVar(&req.TeamId, "team", "", "team the token is scoped to (team scope; default: your token's team)")
	fs.Var(newEnum(&req.Role, adminv1.Role_value, "ROLE_"), "role", "viewer, editor or admin (required)")
	fs.Var(&timeValue{p: &req.ExpireTime}, "expires", "expiry: RFC 3339 time, a date, or a duration from now (30d, 12h); default: never")
	if _, err := a.parse(fs, c, 0, 0); err != nil {
		return err
	}
	if req.Scope == adminv1.Scope_SCOPE_UNSPECIFIED {
		switch {
		case req.TeamId != "":
			req.Scope = adminv1.Scope_SCOPE_TEAM
		case req.OrgId != "":
			req.Scope = adminv1.Scope_SCOPE_ORG
		default:
			return errors.New("token create: --scope is required (platform, org or team)")
		}
	}
	if req.Role == adminv1.Role_ROLE_UNSPECIFIED {
		return errors.New("token create: --role is required (viewer, editor or admin)")
	}
	if req.Name == "" {
		req.Name = enumName(req.Scope.Descriptor(), req.Scope.Number()) + "-" + enumName(req.Role.Descriptor(), req.Role.Number())
	}
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	if req.TeamId != "" && req.OrgId == "" {
		// A team names its org: resolve it rather than ask for --org.
		t, err := call(ctx, cl.teams.GetTeam, &adminv1.GetTeamRequest{Id: req.TeamId})
		if err != nil {
			return fmt.Errorf("token create: resolve the org of team %s: %w", req.TeamId, err)
		}
		req.OrgId = t.GetTeam().GetOrgId()
	}
	r, err := call(ctx, cl.tokens.CreateAdminToken, req)
	if err != nil {
		return err
	}
	a.warnSecret("admin token")
	return p.one(r, r.GetAdminToken(), [2]string{"token", r.GetToken()})
}
