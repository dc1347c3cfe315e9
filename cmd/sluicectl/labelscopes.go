package main

import (
	"context"
	"flag"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Project and tag scopes (LabelScopeService): "sluicectl project ..." and
// "sluicectl tag ..." are the same commands for the two kinds.

var labelScopeColumns = []column[*adminv1.LabelScope]{
	{"ID", (*adminv1.LabelScope).GetId},
	{"ORG", (*adminv1.LabelScope).GetOrgId},
	{"NAME", (*adminv1.LabelScope).GetName},
	{"LIMITS", func(l *adminv1.LabelScope) string { return limitsSummary(l.GetLimits()) }},
	{"CREATED", func(l *adminv1.LabelScope) string { return formatTime(l.GetCreateTime()) }},
}

// labelScopeFields registers the settable fields of a label scope: its
// limits (the name is create-only).
func labelScopeFields(f *fields, l *adminv1.LabelScope) {
	f.Limits(&l.Limits, limitsLabel)
}

func projectCommand() *command {
	return labelScopeCommand("project", adminv1.LabelScopeKind_LABEL_SCOPE_KIND_PROJECT,
		"manage project scopes: limits and budgets shared by every key of a project", "projects")
}

func tagCommand() *command {
	return labelScopeCommand("tag", adminv1.LabelScopeKind_LABEL_SCOPE_KIND_TAG,
		"manage tag scopes: limits and budgets shared by every key carrying a tag", "tags")
}

func labelScopeCommand(noun string, kind adminv1.LabelScopeKind, summary, alias string) *command {
	return group(noun, summary, []*command{
		leaf("create", "NAME", "give a "+noun+" of an org its own limits", func(ctx context.Context, a *app, c *cmdArgs) error {
			return runLabelScopeCreate(ctx, a, c, noun, kind)
		}),
		idCommand("get", "ID", "show a "+noun+" scope", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.labelScopes.GetLabelScope, &adminv1.GetLabelScopeRequest{Id: id})
			return r.GetLabelScope(), err
		}),
		listCommand("", "list "+noun+" scopes", labelScopeColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.LabelScope] {
			req := &adminv1.ListLabelScopesRequest{Kind: kind}
			fs.StringVar(&req.OrgId, "org", "", "only scopes of this org")
			fs.StringVar(&req.NamePrefix, "name-prefix", "", "only scopes whose name starts with this")
			return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.LabelScope, string, error) {
				req.PageSize, req.PageToken = size, tok
				r, err := call(ctx, c.labelScopes.ListLabelScopes, req)
				return r.GetLabelScopes(), r.GetNextPageToken(), err
			}
		}),
		updateCommand(noun, func() *adminv1.LabelScope { return &adminv1.LabelScope{} }, labelScopeFields,
			func(ctx context.Context, c *clients, id string, o *adminv1.LabelScope, mask *fieldmaskpb.FieldMask) (*adminv1.LabelScope, error) {
				o.Id = id
				r, err := call(ctx, c.labelScopes.UpdateLabelScope, &adminv1.UpdateLabelScopeRequest{LabelScope: o, UpdateMask: mask})
				return r.GetLabelScope(), err
			}),
		deleteCommand(noun, func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			return call(ctx, c.labelScopes.DeleteLabelScope, &adminv1.DeleteLabelScopeRequest{Id: id})
		}),
	}, alias)
}

func runLabelScopeCreate(ctx context.Context, a *app, c *cmdArgs, noun string, kind adminv1.LabelScopeKind) error {
	fs := a.flags(c)
	l := &adminv1.LabelScope{}
	fs.StringVar(&l.OrgId, "org", "", "org of the "+noun+" (default: the token's org; required with a platform token)")
	fs.StringVar(&l.Name, "name", "", "the "+noun+" as keys carry it (unique in the org)")
	labelScopeFields(newFields(fs), l)
	if err := a.parseNamed(fs, c, &l.Name, "name"); err != nil {
		return err
	}
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.labelScopes.CreateLabelScope, &adminv1.CreateLabelScopeRequest{
		OrgId: l.OrgId, Kind: kind, Name: l.Name, Limits: l.Limits,
	})
	return p.result(r.GetLabelScope(), err)
}
