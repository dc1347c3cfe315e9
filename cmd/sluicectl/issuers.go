package main

import (
	"context"
	"flag"
	"fmt"
	"strings"

	"google.golang.org/protobuf/proto"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

var issuerColumns = []column[*adminv1.TrustedIssuer]{
	{"ID", (*adminv1.TrustedIssuer).GetId},
	{"ORG", (*adminv1.TrustedIssuer).GetOrgId},
	{"ISSUER", (*adminv1.TrustedIssuer).GetIssuer},
	{"AUDIENCE", (*adminv1.TrustedIssuer).GetAudience},
	{"TEAM CLAIM", (*adminv1.TrustedIssuer).GetTeamClaim},
	{"USER CLAIM", (*adminv1.TrustedIssuer).GetUserClaim},
	{"UNKNOWN", func(i *adminv1.TrustedIssuer) string { return policyName(i.GetUnknownPolicy()) }},
	{"DEFAULT TEAM", (*adminv1.TrustedIssuer).GetDefaultTeamId},
	{"CREATED", func(i *adminv1.TrustedIssuer) string { return formatTime(i.GetCreateTime()) }},
}

func policyName(p adminv1.UnknownIdentityPolicy) string {
	return strings.ToLower(strings.TrimPrefix(p.String(), "UNKNOWN_IDENTITY_POLICY_"))
}

func issuerCommand() *command {
	return group("issuer", "manage trusted JWT/OIDC issuers (docs/jwt.md)", []*command{
		leaf("create", "ISSUER_URL", "trust an issuer's tokens on the data plane", runIssuerCreate),
		idCommand("get", "ISSUER", "show a trusted issuer", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.issuers.GetTrustedIssuer, &adminv1.GetTrustedIssuerRequest{Id: id})
			return r.GetIssuer(), err
		}),
		listCommand("", "list trusted issuers", issuerColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.TrustedIssuer] {
			req := &adminv1.ListTrustedIssuersRequest{}
			fs.StringVar(&req.OrgId, "org", "", "only issuers of this org")
			return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.TrustedIssuer, string, error) {
				req.PageSize, req.PageToken = size, tok
				r, err := call(ctx, c.issuers.ListTrustedIssuers, req)
				return r.GetIssuers(), r.GetNextPageToken(), err
			}
		}),
		deleteCommand("issuer", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			return call(ctx, c.issuers.DeleteTrustedIssuer, &adminv1.DeleteTrustedIssuerRequest{Id: id})
		}),
	}, "issuers")
}

func runIssuerCreate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	req := &adminv1.CreateTrustedIssuerRequest{}
	fs.StringVar(&req.OrgId, "org", "", "org that trusts the issuer (default: the token's org; required with a platform token)")
	fs.StringVar(&req.Issuer, "issuer", "", "the exact iss of its tokens (https)")
	fs.StringVar(&req.Audience, "audience", "", "the aud its tokens must carry")
	fs.StringVar(&req.JwksUrl, "jwks-url", "", "its JWKS (default: OIDC discovery from the issuer URL)")
	fs.StringVar(&req.TeamClaim, "team-claim", "", "dot path of the claim naming the team (name or id)")
	fs.StringVar(&req.UserClaim, "user-claim", "", "dot path of the claim naming the user (e-mail or id)")
	fs.StringVar(&req.CustomerClaim, "customer-claim", "", "dot path of the claim naming the end customer")
	fs.StringVar(&req.ProjectClaim, "project-claim", "", "dot path of the claim naming the project (project scopes limit it, like a key's)")
	fs.StringVar(&req.TagsClaim, "tags-claim", "", "dot path of the claim naming the tags, an array of strings (tag scopes limit them, like a key's)")
	policy := fs.String("unknown", "refuse", "a team or user the org does not have: refuse, or default_team")
	fs.StringVar(&req.DefaultTeamId, "default-team", "", "team id for --unknown default_team or without --team-claim")
	if err := a.parseNamed(fs, c, &req.Issuer, "issuer"); err != nil {
		return err
	}
	switch *policy {
	case "refuse":
		req.UnknownPolicy = adminv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_REFUSE
	case "default_team":
		req.UnknownPolicy = adminv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_DEFAULT_TEAM
	default:
		return fmt.Errorf("--unknown %q: want refuse or default_team", *policy)
	}
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.issuers.CreateTrustedIssuer, req)
	return p.result(r.GetIssuer(), err)
}
